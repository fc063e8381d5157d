# The two commands of the quick start: `make up` and `make test`. Both create .venv/ when needed.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
ARGS   ?=
# Each run's temporary files in a directory of its own: two suites at once (a second checkout's
# `make test`) must not clean up each other's stacks, as pytest's shared default does.
PYTEST  = d=$$(mktemp -d /tmp/llmgw-test.XXXXXX); $(PY) -m pytest -p no:cacheprovider --basetemp=$$d $(ARGS); rc=$$?; rm -rf $$d; [ $$rc -eq 0 ]

.PHONY: install up test test-repeat lint bench clean

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

## Envoy + Redis + services + simulated pods on this machine (ARGS="--pods 4", ARGS="--upstream http://vllm:8000")
up: $(STAMP)
	$(PY) -m llmgw up $(ARGS)

## lint, type-check, then the whole test suite against real Envoy and Redis
test: $(STAMP) lint
	@$(PYTEST)

## the whole suite N times in a row, stopping at the first failure (make test-repeat N=5)
test-repeat: $(STAMP) lint
	@for i in $$(seq $(or $(N),5)); do echo "== run $$i of $(or $(N),5)"; ( $(PYTEST) ) || exit 1; done

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

## a benchmark from bench/ (BENCH=overhead, cpu, wakeups, routing, large_bodies, hostile, extauthz_decision, ratelimit_decision, router_pick, tokenize)
bench: $(STAMP)
	$(PY) -m bench.$(or $(BENCH),overhead) $(ARGS)

clean:
	rm -rf $(VENV) .llmgw .pytest_cache .mypy_cache .ruff_cache
