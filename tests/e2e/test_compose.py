"""The compose deployment, checked without a Docker engine.

- The file against the Compose specification's JSON schema (vendored: tests/schemas/README.md).
- Envoy's config for compose is the template's current rendering, has every filter, validates.
  The gateway topology, as the local stack runs it: the router runs inside extauthz, no router
  service, no ext_proc filter; the pick is read from ext_authz's metadata, the router's access
  log goes to extauthz, and extauthz (started here) scrapes the pods and publishes the fleet
  load to Redis.
- Every service built from our image starts here from the compose file's own command,
  environment and mounted files, with the compose hostnames mapped to loopback (a port of ours
  for each `host:port`), after the services of ours it depends on, and answers the compose
  health check: a compose file whose services could not start fails here. The admin API runs
  too, and extauthz follows its tables: a key made through it is admitted by extauthz, and
  refused once revoked. Redis runs with the compose file's flags (its password too: a
  service without it would not get ready), the vLLM pods are
  simulated, PostgreSQL runs with the compose file's user, database and password (the ledger
  must reach it and apply its schema); the collector is not run (the exporters drop spans).
- Prometheus scrapes every service, Envoy and the pods, and the dashboard names only metrics
  that the running services, the pods and a running Envoy really export.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import redis
import yaml

from llmgw import wire
from llmgw.health import default_probe, default_target
from llmgw.kvblocks import KvHashing
from llmgw.tls import ENVOY_IDENTITY
from ratelimit.redis_store import REPLICAS_KEY
from router.settings import Settings as RouterSettings
from tests.e2e.conftest import api_key
from tests.envoy_config import (
    check_admin_private,
    grpc_loggers,
    pick_sources,
    validated_with_certs,
)
from tests.eventually import eventually
from tests.http import call
from tools import certs, cli, postgres
from tools.procs import Process, bin_path, free_port, grpc_serving, http_ok, redis_ping, stop_all
from tools.stack import Stack

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose"
SCHEMA = ROOT / "tests" / "schemas" / "compose-spec.json"
IMAGE = "${LLMGW_IMAGE:-llmgw:latest}"
TLS_DIR = "/etc/llmgw-tls"  # where our services find compose/tls's files
START_TIMEOUT = 90  # a Python service's start on a loaded 2-core box, several at once

# The command in the compose file's header, and the test that keeps compose/envoy.yaml current.
RENDER = {
    "--listen": "0.0.0.0:8080",
    "--stats": "0.0.0.0:9902",  # the admin stays on loopback
    # extauthz holds the router and the rate limiter (LLMGW_EXTAUTHZ__TOPOLOGY) and is checked
    # over HTTP.
    "--topology": "gateway",
    "--extauthz": "extauthz:9001",
    "--extauthz-http": "extauthz:9011",  # Envoy's checks (LLMGW_EXTAUTHZ__HTTP_PORT)
    "--ledger": "ledger:9004",
    "--otlp": "otel-collector:4317",
    "--pod-key-env": "VLLM_API_KEY",  # the pods' key, from Envoy's environment
    "--tls": "/etc/envoy/tls",  # Envoy's certificates, mounted from compose/tls
    "--access-log": "/var/log/envoy/access.log",  # the volume envoy-log, ledger-reconcile's
}
OURS = ("extauthz", "ledger")  # the services built from our image that Envoy calls (TLS)
ADMIN = "admin"  # the admin API: HTTP, published on the host's loopback only
# Beside Envoy: the ledger's reconciler of Envoy's file access log (python -m ledger.sidecar),
# with the ledger's settings; and the one-shot job that readies the volume they share.
SIDECAR = "ledger-reconcile"
LOG_INIT = "envoy-log-init"
LOG_DIR = "/var/log/envoy"
STATE_DIR = "/var/lib/llmgw"  # the image's state directory (a volume in compose)
PODS = ("vllm-0:8000", "vllm-1:8000")
INTERPOLATION = {
    "LLMGW_SESSION_SECRET": secrets.token_hex(32),
    "POSTGRES_PASSWORD": "compose-test",
    "REDIS_PASSWORD": secrets.token_hex(16),
    "GRAFANA_ADMIN_PASSWORD": "compose-test",
    "VLLM_API_KEY": secrets.token_hex(32),
    "LLMGW_ADMIN_TOKEN": secrets.token_hex(32),
}


def compose() -> dict[str, Any]:
    return dict(yaml.safe_load((COMPOSE / "docker-compose.yaml").read_text()))


def render_argv() -> list[str]:
    argv = ["render-envoy"]
    for flag, value in RENDER.items():
        argv += [flag, value]
    for pod in PODS:
        argv += ["--upstream", pod]
    return argv


def interpolate(value: str, variables: dict[str, str]) -> str:
    """Compose's `${NAME}`, `${NAME:-default}` and `${NAME:?error}`."""

    def one(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3) or ""
        if name in variables and variables[name] != "":
            return variables[name]
        if op == ":?":
            raise AssertionError(f"compose needs ${name}: {arg}")
        return arg if op == ":-" else ""

    return re.sub(r"\$\{(\w+)(:-|:\?)?([^}]*)\}", one, value)


# The file itself.


def test_compose_file_follows_the_compose_spec() -> None:
    schema = json.loads(SCHEMA.read_text())
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(compose()), key=str)
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_compose_runs_the_whole_product() -> None:
    services = compose()["services"]
    product = {"envoy", *OURS, "redis", "postgres"}
    product |= {"vllm-0", "vllm-1", "otel-collector", "prometheus", "grafana"}
    assert product <= set(services)
    assert {n for n, s in services.items() if s.get("image") == IMAGE} == {
        *OURS,
        SIDECAR,
        LOG_INIT,
        ADMIN,
    }
    for name in (*OURS, ADMIN):
        assert services[name]["command"] == [name]
    # The admin API and extauthz read the tables the ledger's database holds.
    url = services["ledger"]["environment"]["LLMGW_LEDGER__DATABASE_URL"]
    assert services[ADMIN]["environment"]["LLMGW_ADMIN__DATABASE_URL"] == url
    assert services["extauthz"]["environment"]["LLMGW_EXTAUTHZ__TENANTS_DATABASE_URL"] == url
    # No outcome lost: Envoy's file access log, flushed every 200 ms, on the volume the
    # reconciler reads; both wait for the volume to be Envoy's and our group's.
    assert services[SIDECAR]["command"] == ["ledger.sidecar"]
    log = services[SIDECAR]["environment"]["LLMGW_LEDGER__RECONCILE__ACCESS_LOG"]
    assert log == RENDER["--access-log"] and log.startswith(LOG_DIR + "/")
    for name in ("envoy", SIDECAR, LOG_INIT):
        assert f"envoy-log:{LOG_DIR}" in services[name]["volumes"], name
    for name in ("envoy", SIDECAR):
        assert services[name]["depends_on"][LOG_INIT] == {
            "condition": "service_completed_successfully"
        }
    envoy = services["envoy"]["command"]
    assert envoy[envoy.index("--file-flush-interval-msec") + 1] == "200"
    for key in ("DATABASE_URL", "REDIS__HOST", "REDIS__PASSWORD", "REDIS__CLUSTER"):
        ledger = services["ledger"]["environment"][f"LLMGW_LEDGER__{key}"]
        assert services[SIDECAR]["environment"][f"LLMGW_LEDGER__{key}"] == ledger, key
    # Envoy starts once every service of ours and every pod is healthy; no router service.
    assert "router" not in services
    assert set(services["envoy"]["depends_on"]) == {*OURS, "vllm-0", "vllm-1", LOG_INIT}
    for name in ("vllm-0", "vllm-1"):
        flags = services[name]["command"]
        assert {"--enable-prefix-caching", "--enable-force-include-usage"} <= set(flags)
        assert "--scheduling-policy=priority" in flags
    redis = services["redis"]["command"]
    assert "--appendonly" in redis and redis[redis.index("--appendonly") + 1] == "yes"
    assert any(v.endswith(":/data") for v in services["redis"]["volumes"])
    # Redis asks for a password, and every client gets it from the same variable.
    password = "${REDIS_PASSWORD:?set REDIS_PASSWORD (openssl rand -hex 16)}"
    assert redis[redis.index("--requirepass") + 1] == password
    assert services["redis"]["environment"]["REDISCLI_AUTH"] == password  # the health check
    assert services["ledger"]["environment"]["LLMGW_LEDGER__REDIS__PASSWORD"] == password
    assert services[ADMIN]["environment"]["LLMGW_ADMIN__REDIS__PASSWORD"] == password  # breakers
    # extauthz holds the router: it picks, scrapes the pods and publishes the fleet load; and
    # the rate limiter: it admits in each Check, its counters in the same Redis.
    extauthz = services["extauthz"]["environment"]
    assert extauthz["LLMGW_EXTAUTHZ__TOPOLOGY"] == RENDER["--topology"]
    assert json.loads(extauthz["LLMGW_ROUTER__FLEET__PODS"]) == list(PODS)
    for client in ("LLMGW_ROUTER__REDIS", "LLMGW_RATELIMIT__REDIS"):
        assert extauthz[f"{client}__HOST"] == "redis"
        assert extauthz[f"{client}__PASSWORD"] == password
    cluster = services["ledger"]["environment"]["LLMGW_LEDGER__REDIS__CLUSTER"]
    assert extauthz["LLMGW_ROUTER__REDIS__CLUSTER"] == cluster  # one switch for every client
    assert extauthz["LLMGW_RATELIMIT__REDIS__CLUSTER"] == cluster
    assert services["extauthz"]["depends_on"]["redis"] == {"condition": "service_healthy"}
    # Only the router's fleet, plugins, profile and Redis settings apply inside extauthz; a
    # SERVE__PORT of its own would also leave the health check two ports to choose from.
    held = [k for k in extauthz if k.startswith(("LLMGW_ROUTER__", "LLMGW_RATELIMIT__"))]
    assert not [k for k in held if "__SERVE__" in k or "__TRACING__" in k]
    assert any("postgresql/data" in v for v in services["postgres"]["volumes"])
    # The pods ask for one key on /v1; Envoy sends it (--pod-key-env), and the router scraping
    # their /v1/models.
    pod_key = "${VLLM_API_KEY:?set VLLM_API_KEY (openssl rand -hex 32)}"
    for name in ("vllm-0", "vllm-1", "envoy"):
        assert services[name]["environment"]["VLLM_API_KEY"] == pod_key, name
    assert extauthz["LLMGW_ROUTER__FLEET__POD_API_KEY"] == pod_key
    # The pods' network holds only their clients: the KV events carry prompts' token IDs.
    on_pods = {name for name, s in services.items() if "pods" in s.get("networks", [])}
    assert on_pods == {"vllm-0", "vllm-1", "envoy", "extauthz", "prometheus"}
    assert services["vllm-0"]["networks"] == ["pods"]
    # The router subscribes where every pod publishes its KV events, and extauthz hashes a
    # request's blocks as the pods hash theirs.
    router = RouterSettings.model_validate(
        {"fleet": {"kv_events": json.loads(extauthz["LLMGW_ROUTER__FLEET__KV_EVENTS"])}}
    )
    events = router.fleet.kv_events
    assert events is not None
    hashing = KvHashing.model_validate_json(extauthz["LLMGW_EXTAUTHZ__DECISION__KV_HASHING"])
    for name in ("vllm-0", "vllm-1"):
        flags = services[name]["command"]
        config = json.loads(next(f for f in flags if f.startswith("--kv-events-config="))[19:])
        assert config["endpoint"] == f"tcp://*:{events.port}"
        assert config["replay_endpoint"] == f"tcp://*:{events.replay_port}"
        assert {str(events.port), str(events.replay_port)} <= set(services[name]["expose"])
        assert f"--prefix-caching-hash-algo={hashing.algo}" in flags
        assert services[name]["environment"]["PYTHONHASHSEED"] == hashing.seed
    # Only the gateway, and Grafana and the admin API on the host's loopback, are published:
    # nothing reaches a service or a GPU pod around Envoy.
    published = {name: s["ports"] for name, s in services.items() if "ports" in s}
    assert published == {
        "envoy": ["8080:8080"],
        "grafana": ["127.0.0.1:3000:3000"],
        ADMIN: ["127.0.0.1:8086:8086"],
    }
    assert "./envoy.yaml:/etc/envoy/envoy.yaml:ro" in services["envoy"]["volumes"]


def test_compose_envoy_config_is_current_has_every_filter_and_validates(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    header = (COMPOSE / "docker-compose.yaml").read_text()
    for flag, value in RENDER.items():
        assert f"{flag} {value}" in header, f"the header's render command lacks {flag} {value}"
    assert "--router " not in header and "--ratelimit " not in header  # no such services
    assert cli.main(render_argv()) == 0
    rendered = capsys.readouterr().out
    assert (COMPOSE / "envoy.yaml").read_text() == rendered, (
        "compose/envoy.yaml is stale: re-render it with the command in docker-compose.yaml"
    )
    for needed in (
        "envoy.filters.http.ext_authz",
        "envoy.access_loggers.http_grpc",
        "envoy.tracers.opentelemetry",
    ):
        assert needed in rendered, needed
    # The pick and the admission are made inside extauthz's Check.
    assert "envoy.filters.http.ext_proc" not in rendered
    assert "envoy.filters.http.ratelimit" not in rendered
    config = yaml.safe_load(rendered)
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    http = ("extauthz_http", "extauthz_keys")  # extauthz's HTTP port: checks, key questions
    assert set(clusters) == {"pods", *OURS, *http, "otel", "admin"}
    for name in (*OURS, *http, "otel"):
        assert clusters[name]["type"] == "STRICT_DNS", name  # compose names, resolved by Envoy
    # override_host takes the pick from ext_authz's metadata; the router's access log (how each
    # pick ended) goes to extauthz, which holds the router.
    sources = pick_sources(config)
    assert [src["metadata"]["key"] for src in sources] == [wire.EXTAUTHZ_NAMESPACE]
    loggers = {"ledger": "ledger", "router": "extauthz", "router_soon": "extauthz"}
    assert grpc_loggers(config) == loggers
    # Mutual TLS to each of ours, the HTTP check port included; the collector is not ours.
    for name, cluster in clusters.items():
        tls = cluster.get("transport_socket", {}).get("typed_config", {})
        context = tls.get("common_tls_context", {})
        sans = context.get("validation_context", {}).get("match_typed_subject_alt_names")
        served = "extauthz" if name in http else name  # whose certificate
        wanted = [{"san_type": "DNS", "matcher": {"exact": served}}] if served in OURS else None
        assert sans == wanted, name
    check_admin_private(config)
    # Envoy opens its access log's directory (the container's volume) at start.
    validated_with_certs(rendered.replace(LOG_DIR, str(tmp_path)), RENDER["--tls"], tmp_path)


def test_each_container_mounts_its_own_certificate_and_key_only() -> None:
    """Mutual TLS (llmgw/tls.py): each of ours serves with its own pair from compose/tls and
    the CA; Envoy's mounts are where the rendered config (--tls) reads them. No other key."""
    services = compose()["services"]
    for name in OURS:
        env = services[name]["environment"]
        prefix = f"LLMGW_{name.upper()}__SERVE__TLS__"
        named = {env[prefix + "CERT"], env[prefix + "KEY"], env[prefix + "CA"]}
        files = {f"{name}.crt", f"{name}.key", certs.CA_FILE}
        assert named == {f"{TLS_DIR}/{f}" for f in files}
        mounts = {m for m in services[name].get("volumes", []) if m.startswith("./tls/")}
        assert mounts == {f"./tls/{f}:{TLS_DIR}/{f}:ro" for f in files}, name
    envoy = {m for m in services["envoy"]["volumes"] if m.startswith("./tls/")}
    files = {certs.CA_FILE, "envoy.crt", "envoy.key"}
    assert envoy == {f"./tls/{f}:{RENDER['--tls']}/{f}:ro" for f in files}


def test_render_envoy_refuses_a_gateway_without_authentication(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["render-envoy", "--upstream", "vllm-0:8000"]) == 2
    assert "--insecure-no-auth" in capsys.readouterr().err
    argv = ["render-envoy", "--upstream", "vllm-0:8000", "--insecure-no-auth"]
    assert cli.main(argv) == 0
    assert "envoy.filters.http.ext_authz\n" not in capsys.readouterr().out  # the filter


# The services, started here from the compose file.


@dataclass
class Started:
    spec: dict[str, Any]
    ports: dict[tuple[str, int], int] = field(default_factory=dict)
    envs: dict[str, dict[str, str]] = field(default_factory=dict)
    processes: list[Process] = field(default_factory=list)

    def port(self, service: str, port: int) -> int:
        """The loopback port standing for `service:port` of the compose network."""
        return self.ports.setdefault((service, port), free_port())

    def url(self, target: str, path: str = "/metrics") -> str:
        host, _, port = target.rpartition(":")
        return f"http://127.0.0.1:{self.port(host, int(port))}{path}"


def localise(
    name: str, environment: dict[str, str], started: Started, files: Path
) -> dict[str, str]:
    """The compose environment of service `name`, with compose addresses mapped to loopback."""
    services = set(started.spec["services"])
    env = {k: interpolate(str(v), INTERPOLATION) for k, v in environment.items()}
    out: dict[str, str] = {}
    for key, value in env.items():
        if key.endswith("_HOST") and (value in services or value == "0.0.0.0"):
            value = "127.0.0.1"
        elif key.endswith("_PORT"):
            peer = env.get(key[: -len("PORT")] + "HOST", "")
            value = str(started.port(peer if peer in services else name, int(value)))
        else:
            for service in services:
                value = re.sub(
                    rf"(?<![\w.-]){re.escape(service)}:(\d+)",
                    lambda m, s=service: f"127.0.0.1:{started.port(s, int(m.group(1)))}",
                    value,
                )
            value = value.replace(TLS_DIR, str(files.parent / "tls"))  # certs.generate's
            value = value.replace("/etc/llmgw", str(files))
            value = value.replace(LOG_DIR, str(files.parent / "envoy-log"))
            value = value.replace(STATE_DIR, str(files.parent / f"{name}-state"))
        out[key] = value
    return out


@pytest.fixture(scope="module")
def started(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Started]:
    tmp = tmp_path_factory.mktemp("compose")
    spec = compose()
    run = Started(spec)
    files = tmp / "config"  # compose mounts ./config at /etc/llmgw
    shutil.copytree(COMPOSE / "config", files)
    certs.generate(tmp / "tls")  # `llmgw certs --out compose/tls`
    try:
        # The compose file's own flags, with its password.
        redis_flags = [interpolate(f, INTERPOLATION) for f in spec["services"]["redis"]["command"]]
        port = run.port("redis", 6379)
        argv = [bin_path("redis-server"), *redis_flags[1:], "--port", str(port)]
        argv += ["--bind", "127.0.0.1", "--dir", str(tmp)]
        ready = redis_ping("127.0.0.1", port, INTERPOLATION["REDIS_PASSWORD"])
        run.processes.append(Process("redis", argv, ready, tmp / "r.log"))
        # PostgreSQL with the compose file's user, database and password (the ledger's URL).
        pg = spec["services"]["postgres"]["environment"]
        assert (pg["POSTGRES_USER"], pg["POSTGRES_DB"]) == (postgres.USER, postgres.DATABASE)
        home = tmp / "postgres"
        home.mkdir()
        (home / "password").write_text(interpolate(pg["POSTGRES_PASSWORD"], INTERPOLATION) + "\n")
        run.processes.append(postgres.Postgres(home, tmp / "pg.log", run.port("postgres", 5432)))
        for pod in PODS:
            host, _, pod_port = pod.partition(":")
            port = run.port(host, int(pod_port))
            argv = [sys.executable, "-m", "sim", "--port", str(port), "--time-scale", "0.05"]
            ready = http_ok(f"http://127.0.0.1:{port}/health")
            # The pod's key, as the compose file gives it to vLLM.
            pod_env = spec["services"][host]["environment"]
            key = {"VLLM_API_KEY": interpolate(pod_env["VLLM_API_KEY"], INTERPOLATION)}
            env = {**os.environ, **key}
            run.processes.append(Process(host, argv, ready, tmp / f"{host}.log", env))
        later: list[Process] = []  # compose starts these after those of ours they depend on
        base = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
        ours = {n: s for n, s in spec["services"].items() if s.get("image") == IMAGE}
        for name, service in ours.items():
            if "command" not in service:  # LOG_INIT
                continue
            env = localise(name, service.get("environment", {}), run, files)
            run.envs[name] = env
            (files.parent / f"{name}-state").mkdir()
            argv = [sys.executable, "-m", *service["command"]]
            ready = default_probe(env)[1]  # its health: the plaintext port, or the admin's HTTP
            proc = Process(name, argv, ready, tmp / f"{name}.log", {**base, **env})
            run.processes.append(proc)
            if set(service.get("depends_on", {})) & set(ours):
                later.append(proc)
        for batch in ([p for p in run.processes if p not in later], later):
            for proc in batch:
                proc.spawn()
            for proc in batch:
                proc.wait_ready(START_TIMEOUT)
        yield run
    finally:
        stop_all(run.processes)


def test_every_compose_service_of_ours_starts_here_and_passes_its_health_check(
    started: Started,
) -> None:
    assert set(started.envs) == {*OURS, SIDECAR, ADMIN}
    base = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    for name, env in started.envs.items():
        test = started.spec["services"][name]["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "-m"], test
        result = subprocess.run(
            [sys.executable, "-m", *test[3:]],
            env={**base, **env},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, (name, result.stderr)


def test_our_ports_take_only_tls_and_health_is_plaintext_on_its_own(started: Started) -> None:
    for name in OURS:
        env = started.envs[name]
        port = env[f"LLMGW_{name.upper()}__SERVE__PORT"]
        assert not grpc_serving(f"127.0.0.1:{port}")(), name  # plaintext: the handshake fails
        assert grpc_serving(default_target(env))(), name


def test_the_ledger_reaches_postgresql_with_the_compose_credentials(started: Started) -> None:
    """The ledger's DATABASE_URL and the postgres service's settings agree: its schema lands."""
    url = started.envs["ledger"]["LLMGW_LEDGER__DATABASE_URL"]

    async def outcomes_table() -> bool:
        import asyncpg

        conn = await asyncpg.connect(url, timeout=5)
        try:
            return bool(await conn.fetchval("SELECT to_regclass('outcomes') IS NOT NULL"))
        finally:
            await conn.close()

    what = "the ledger never applied its schema"
    eventually(lambda: asyncio.run(outcomes_table()), START_TIMEOUT, what, every_s=0.1)


def test_the_limiter_in_extauthz_decides_from_redis_with_the_compose_password(
    started: Started,
) -> None:
    """The compose Redis refuses a client without its password; the rate limiter in extauthz,
    given it, beats in Redis's replica set and is not degraded (a wrong or missing password
    would leave it on in-process counters)."""
    port = started.port("redis", 6379)
    with redis.Redis(port=port) as anonymous, pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    metrics = started.url("extauthz:9101")
    with redis.Redis(port=port, password=INTERPOLATION["REDIS_PASSWORD"]) as client:
        eventually(
            lambda: client.zcard(REPLICAS_KEY) and "llmgw_ratelimit_degraded 0.0" in fetch(metrics),
            START_TIMEOUT,
            "the rate limiter never reached Redis",
            every_s=0.1,
        )


def test_the_admin_api_is_on_the_hosts_loopback_only_and_extauthz_follows_its_tables() -> None:
    """Published on 127.0.0.1 alone and routed by no Envoy listener; extauthz follows the
    database and keeps its snapshot in a volume of its own, mounted at the image's state
    directory, which the image gives to its user (a new volume takes the directory's owner)."""
    services = compose()["services"]
    admin = services[ADMIN]
    assert admin["ports"] == ["127.0.0.1:8086:8086"]
    assert [f"{ADMIN}:" in p for p in RENDER.values()] == [False] * len(RENDER)
    envoy = (COMPOSE / "envoy.yaml").read_text()
    assert "8086" not in envoy and "address: admin" not in envoy
    env = services["extauthz"]["environment"]
    assert env["LLMGW_EXTAUTHZ__TENANTS_SOURCE"] == "database"
    cache = Path(env["LLMGW_EXTAUTHZ__TENANTS_CACHE"])
    assert cache.parent == Path(STATE_DIR)
    assert f"extauthz-state:{STATE_DIR}" in services["extauthz"]["volumes"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert f"install -d -o 10001 -g 10001 -m 0700 {STATE_DIR}" in dockerfile
    assert "USER 10001:10001" in dockerfile
    # The token and the database's password come from the operator's environment.
    assert admin["environment"]["LLMGW_ADMIN__ADMIN_TOKEN"].startswith("${LLMGW_ADMIN_TOKEN:?")


def checked(started: Started, key: str) -> int:
    """The status of extauthz's HTTP check (Envoy's, over mutual TLS) of a request with `key`."""
    tls = started.envs["extauthz"]["LLMGW_EXTAUTHZ__SERVE__TLS__CA"]
    context = ssl.create_default_context(cafile=tls)
    pair = Path(tls).parent / ENVOY_IDENTITY
    context.load_cert_chain(pair.with_suffix(".crt"), pair.with_suffix(".key"))
    port = int(started.envs["extauthz"]["LLMGW_EXTAUTHZ__HTTP_PORT"])
    request = (
        f"GET /v1/models HTTP/1.1\r\nhost: envoy\r\nauthorization: Bearer {key}\r\n"
        "content-length: 0\r\nconnection: close\r\n\r\n"
    ).encode()
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="extauthz") as conn,
    ):
        conn.sendall(request)
        return int(conn.recv(64).split(b" ", 2)[1])


def test_a_key_made_through_the_admin_api_is_admitted_by_extauthz_and_refused_once_revoked(
    started: Started,
) -> None:
    """The compose admin API and extauthz share the tenants' tables (the database URL and the
    token from the operator's environment): a tenant and a key made through the API pass
    extauthz's check within 2 s (bounded here by the start-up timeout: a busy machine), and a
    revocation stops the key."""
    admin = f"http://127.0.0.1:{started.port(ADMIN, 8086)}/admin/v1"
    auth = {"authorization": f"Bearer {INTERPOLATION['LLMGW_ADMIN_TOKEN']}"}
    assert call("GET", f"{admin}/tenants").status == 401  # the token is asked for
    tenant = {"id": "compose", "name": "C", "tier": "standard", "priority": 5, "models": "*"}
    assert call("POST", f"{admin}/tenants", tenant, auth).status == 200
    made = call("POST", f"{admin}/tenants/compose/keys", {}, auth)
    assert made.status == 200, made.body
    key, key_id = made.json()["key"], made.json()["id"]
    assert checked(started, "sk-llmgw-" + "0" * 40) == 401  # the control: a made-up key
    eventually(lambda: checked(started, key) == 200, START_TIMEOUT, "the key never worked")
    assert call("DELETE", f"{admin}/keys/{key_id}", headers=auth).status == 200
    eventually(lambda: checked(started, key) == 401, START_TIMEOUT, "the revoked key worked on")
    # Its breaker's state, from the compose Redis with the compose password.
    breaker = call("GET", f"{admin}/tenants/compose/breaker", headers=auth)
    assert (breaker.status, breaker.json()["state"]) == (200, "closed"), breaker.body


def test_the_router_in_extauthz_scrapes_the_pods_and_publishes_to_redis(started: Started) -> None:
    """extauthz, given the compose pods and Redis URL, holds a router that finds both pods
    pickable (their /metrics and /v1/models scraped) and publishes the fleet load to Redis with
    the compose password; its metrics are extauthz's."""
    metrics = started.url("extauthz:9101")
    pods = []
    for pod in PODS:
        host, _, pod_port = pod.partition(":")
        pods.append(f"127.0.0.1:{started.port(host, int(pod_port))}")
    wanted = [f'llmgw_router_pod_pickable{{pod="{pod}"}} 1.0' for pod in pods]
    deadline = time.monotonic() + START_TIMEOUT
    while not all(line in fetch(metrics) for line in wanted):
        assert time.monotonic() < deadline, f"extauthz's router never found the pods: {wanted}"
        time.sleep(0.1)
    port = started.port("redis", 6379)
    with redis.Redis(port=port, password=INTERPOLATION["REDIS_PASSWORD"]) as client:
        while (payload := client.get(wire.FLEET_LOAD_KEY)) is None:
            assert time.monotonic() < deadline, "extauthz's router never published the load"
            time.sleep(0.1)
    assert "load" in json.loads(payload)


def exported(text: str) -> set[str]:
    """Metric names in a Prometheus exposition, with a histogram's _bucket/_sum/_count."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            names.add(name)
            if kind.strip() == "counter":  # sampled as NAME_total, and none before an increment
                names.add(f"{name}_total")
            if kind.strip() in ("histogram", "summary"):
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return str(resp.read().decode())


def test_prometheus_scrapes_every_service_envoy_and_the_pods(started: Started) -> None:
    config = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    targets = {
        name: [t for sc in job["static_configs"] for t in sc["targets"]]
        for name, job in jobs.items()
    }
    services = started.spec["services"]
    for target in [t for ts in targets.values() for t in ts]:
        host, _, port = target.rpartition(":")
        assert port in services[host]["expose"], f"{target}: not exposed by compose"
    scraped = {t.partition(":")[0] for t in targets["llmgw"]} | {
        t.partition(":")[0] for t in targets["vllm"] + targets[ADMIN]
    }
    assert scraped == set(started.envs) | {"vllm-0", "vllm-1"}
    for target in targets["llmgw"]:
        host = target.partition(":")[0]
        service = started.spec["services"][host]["command"][0].partition(".")[0]  # its settings'
        metrics_port = int(
            started.spec["services"][host]["environment"][
                f"LLMGW_{service.upper()}__SERVE__METRICS_PORT"
            ]
        )
        assert target == f"{host}:{metrics_port}"
        names = exported(fetch(started.url(target)))
        assert any(n.startswith(f"llmgw_{service}_") for n in names)
    assert "llmgw_ledger_reconciled_total" in exported(fetch(started.url(f"{SIDECAR}:9105")))
    # The admin API's metrics are beside its routes, on its one port.
    assert targets[ADMIN] == [f"{ADMIN}:{services[ADMIN]['environment']['LLMGW_ADMIN__PORT']}"]
    assert "llmgw_admin_requests_total" in exported(fetch(started.url(targets[ADMIN][0])))
    # The router's metrics are served by extauthz, which holds it.
    extauthz = exported(fetch(started.url("extauthz:9101")))
    assert "llmgw_router_fleet_load" in extauthz
    for target in targets["vllm"]:
        assert "vllm:num_requests_running" in exported(fetch(started.url(target)))
    assert jobs["envoy"]["metrics_path"] == "/stats/prometheus"
    assert targets["envoy"] == [RENDER["--stats"].replace("0.0.0.0", "envoy")]
    # The health check asks the stats listener too (the admin is on Envoy's loopback).
    assert "/dev/tcp/127.0.0.1/9902" in " ".join(services["envoy"]["healthcheck"]["test"])


def test_the_dashboard_names_only_metrics_that_are_exported(started: Started, stack: Stack) -> None:
    key = api_key(stack)
    auth = {"authorization": f"Bearer {key}"}
    model = call("GET", f"{stack.base_url}/models", headers=auth).json()["data"][0]["id"]
    body = {"model": model, "prompt": "dashboard", "max_tokens": 2}
    assert call("POST", f"{stack.base_url}/completions", body, auth).status == 200
    names = exported(fetch(f"{stack.admin_url}/stats/prometheus"))
    for target in ("extauthz:9101", "ledger:9104"):  # the router's and limiter's: extauthz's
        names |= exported(fetch(started.url(target)))
    names |= exported(fetch(started.url(PODS[0])))

    board = json.loads((COMPOSE / "grafana" / "dashboards" / "llmgw.json").read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    metric = r"\b(?:llmgw_|vllm:|envoy_)[\w:]+(?![\w:])(?!\s*[=!])"  # a name, not a label
    used = {m for e in exprs for m in re.findall(metric, e)}
    assert used - names == set(), "the dashboard names metrics nobody exports"
    provider = yaml.safe_load(
        (COMPOSE / "grafana" / "provisioning" / "dashboards" / "llmgw.yaml").read_text()
    )
    mounts = started.spec["services"]["grafana"]["volumes"]
    assert f"./grafana/dashboards:{provider['providers'][0]['options']['path']}:ro" in mounts
