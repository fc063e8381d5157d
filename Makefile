# The two commands of the quick start: `make up` and `make test`. Both create .venv/ when needed.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
ARGS   ?=
# Real vLLM's environment (tools/engine.py), apart from the services'; one for many checkouts:
# VLLM_VENV=/shared/venv-vllm. Its lock and install log sit beside it.
VLLM_VENV ?= .venv-vllm
# Each run's temporary files in a directory of its own: two suites at once (a second checkout's
# `make test`) must not clean up each other's stacks, as pytest's shared default does.
# The vLLM environment installs meanwhile, in the background and niced (~9 minutes when missing;
# output in its install log): the real-vLLM tier runs last and waits for it (the install's lock).
# When pytest ends, what is left of the install is stopped; the exit status is pytest's.
# Two workers, one per core: most of a test's time is spent waiting on its stack's processes.
# Each module runs on one worker, the real-vLLM tier on one, last (tests/conftest.py scope_of);
# WORKERS= runs in one process.
WORKERS ?= -n 2 --dist loadfile
PYTEST  = d=$$(mktemp -d /tmp/llmgw-test.XXXXXX); \
	setsid nice -n 19 $(PY) -m tools.engine >/dev/null 2>>"$$LLMGW_STACK__VLLM__VENV.install.log" & bg=$$!; \
	trap 'kill -TERM -$$bg 2>/dev/null; rm -rf $$d' EXIT; trap 'exit 130' INT TERM; \
	$(PY) -m pytest -p no:cacheprovider --basetemp=$$d $(WORKERS) $(ARGS)

.PHONY: install up test test-repeat vllm lint bench clean chromium

# The stack, the tests, the benches and `make vllm` find the environment here (tools.engine.configured).
up test test-repeat vllm bench: export LLMGW_STACK__VLLM__VENV := $(abspath $(VLLM_VENV))

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	@# xds-protos ships an old copy of opentelemetry/proto/*: put opentelemetry-proto's own back,
	@# or the OTLP exporter cannot import (tests/e2e/test_tracing.py).
	$(PY) -m pip install --quiet --force-reinstall --no-deps \
		"opentelemetry-proto==$$($(PY) -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')"
	touch $@

install: $(STAMP)

## Envoy + Redis + services + simulated pods on this machine (ARGS="--pods 4", ARGS="--engine vllm", ARGS="--upstream http://vllm:8000")
up: $(STAMP)
	$(PY) -m llmgw up $(ARGS)

## lint, type-check, then the whole test suite against real Envoy and Redis
test: $(STAMP) lint chromium
	@$(PYTEST)

# The console's browser test (tests/e2e/test_console_browser.py) drives Debian's chromium over
# the DevTools protocol: installed here when missing, as root with apt-get (its output in
# .chromium-install.log). Not fatal: without it, that test skips and says why.
chromium:
	@if [ ! -x /usr/bin/chromium ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Debian's chromium for the console's browser test (.chromium-install.log)"; \
		{ apt-get install -y --no-install-recommends chromium \
		  || { apt-get update && apt-get install -y --no-install-recommends chromium; }; \
		} >.chromium-install.log 2>&1 || echo "chromium not installed: its browser test will skip"; \
	fi

## real vLLM's CPU build in $(VLLM_VENV) (~9 minutes, ~3.5 GB, once) and the tiny model it serves
vllm: $(STAMP)
	$(PY) -m tools.engine

## the whole suite N times in a row, stopping at the first failure (make test-repeat N=5)
test-repeat: $(STAMP) lint chromium
	@for i in $$(seq $(or $(N),5)); do echo "== run $$i of $(or $(N),5)"; ( $(PYTEST) ) || exit 1; done

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

## a benchmark from bench/ (BENCH=overhead, cpu, wakeups, routing, flow, large_bodies, hostile, extauthz_decision, ratelimit_decision, router_pick, tokenize, vllm_startup, vllm_overhead, vllm_scrape, kv_index, collectors, responses, gputime, tenants_db, admin_http)
bench: $(STAMP)
	$(PY) -m bench.$(or $(BENCH),overhead) $(ARGS)

clean:
	rm -rf $(VENV) .llmgw .pytest_cache .mypy_cache .ruff_cache
