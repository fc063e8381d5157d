"""The service over real gRPC, with CheckRequests filled the way Envoy fills them."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.accesslog.v3 import als_pb2_grpc
from envoy.service.auth.v3 import attribute_context_pb2, external_auth_pb2, external_auth_pb2_grpc
from google.protobuf import json_format
from google.rpc import code_pb2
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from extauthz import cli, metrics
from extauthz.__main__ import cli as service_cli
from extauthz.bodypool import BodyPool
from extauthz.director import Director
from extauthz.service import register
from extauthz.store import TenantsStore, tenants_store
from llmgw import authzhttp, wire
from llmgw.facts import MESSAGE_TOKENS
from llmgw.reload import RELOADS
from router.engine import Engine
from router.fleet import Fleet, FleetSettings
from router.registry import DEFAULT_PLUGINS, DEFAULT_PROFILE, default_registry
from router.runtime import Router
from router.types import PodMetrics
from tests.extauthz.conftest import SECRET, TIERS_YAML, Keys, kill_worker, make_decider
from tests.router.test_service import log_entry, send_log
from tools.procs import Process, free_port, grpc_serving

Stub: Any = external_auth_pb2_grpc.AuthorizationStub
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


def check_request(
    headers: dict[str, str], body: bytes = b"", raw: bool = True
) -> external_auth_pb2.CheckRequest:
    method, path = ("POST", "/v1/chat/completions") if body else ("GET", "/v1/models")
    http = attribute_context_pb2.AttributeContext.HttpRequest(
        method=method,
        path=path,
        host="gateway",
        headers={":method": method, ":path": path, **headers},
        size=len(body) if body else -1,
    )
    if raw:
        http.raw_body = body
    else:
        http.body = body.decode()
    return external_auth_pb2.CheckRequest(
        attributes=attribute_context_pb2.AttributeContext(
            request=attribute_context_pb2.AttributeContext.Request(http=http)
        )
    )


CHAT = json.dumps(
    {"model": "llama-3-8b", "messages": [{"role": "user", "content": "hi" * 200}], "max_tokens": 9}
).encode()


PODS = ["10.0.0.1:8000", "10.0.0.2:8000"]


class Running:
    def __init__(
        self, channel: grpc.aio.Channel, store: TenantsStore, spans: InMemorySpanExporter
    ) -> None:
        self.stub = Stub(channel)
        self.logs = als_pb2_grpc.AccessLogServiceStub(channel)
        self.store = store
        self.spans = spans


async def _running(
    tenants_file: Path, tiers_file: Path, router: Router | None
) -> AsyncIterator[Running]:
    store = tenants_store(tenants_file, tiers_file)
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    tracer = provider.get_tracer("test")
    if router is not None:
        router.tracer = tracer
    service = Director(store, make_decider(), tracer, router=router)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    register(service)(server)
    if router is not None:
        router.register(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    watcher = asyncio.create_task(store.watch(0.25))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield Running(channel, store, spans)
    finally:
        watcher.cancel()
        await server.stop(0)
        provider.shutdown()


@pytest.fixture
async def running(tenants_file: Path, tiers_file: Path, keys: Keys) -> AsyncIterator[Running]:
    async for r in _running(tenants_file, tiers_file, None):
        yield r


def make_router() -> Router:
    fleet = Fleet(FleetSettings(capacity=10, stale_after=60))
    fleet.set_pods(PODS)
    for pod in PODS:
        fleet.snapshots[pod] = PodMetrics(
            pod, fleet.clock(), ok=True, models=frozenset({"llama-3-8b"})
        )
    engine = Engine(default_registry().build(DEFAULT_PLUGINS, DEFAULT_PROFILE))
    return Router(fleet, engine, TracerProvider().get_tracer("unused"))


@pytest.fixture
def router() -> Router:
    return make_router()


@pytest.fixture
async def picking(
    tenants_file: Path, tiers_file: Path, keys: Keys, router: Router
) -> AsyncIterator[Running]:
    async for r in _running(tenants_file, tiers_file, router):
        yield r


def header_map(options: object) -> dict[str, str]:
    return {o.header.key: o.header.value for o in options}  # type: ignore[attr-defined]


@pytest.mark.parametrize("raw", [True, False])
async def test_allow_over_grpc(running: Running, keys: Keys, raw: bool) -> None:
    traceparent = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
    headers = {
        "authorization": f"Bearer {keys.acme}",
        "x-request-id": "req-42",
        "traceparent": traceparent,
        wire.HEADER_TENANT: "globex",
    }
    before = metrics.DECISIONS.labels(result="allow", tenant="acme")._value.get()
    reply = await running.stub.Check(check_request(headers, CHAT, raw=raw))

    assert reply.status.code == code_pb2.OK
    assert reply.WhichOneof("http_response") == "ok_response"
    ok = reply.ok_response
    set_headers = header_map(ok.headers)
    assert set_headers[wire.HEADER_TENANT] == "acme"
    # "hi" × 200 and its role / 4, the chat template's tokens around one message, max_tokens.
    assert set_headers[wire.HEADER_TOKEN_ESTIMATE] == str(101 + 2 * MESSAGE_TOKENS + 9)
    assert all(
        o.append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
        for o in [*ok.headers, *ok.response_headers_to_add]
    )
    assert list(ok.headers_to_remove) == ["authorization"]
    session = set_headers[wire.HEADER_SESSION]
    assert header_map(ok.response_headers_to_add) == {wire.HEADER_SESSION: session}
    assert not ok.HasField("dynamic_metadata")  # deprecated field: it would replace the real one

    meta = json_format.MessageToDict(reply.dynamic_metadata)
    assert meta[wire.META_TENANT] == "acme"
    assert meta[wire.META_SESSION] == session
    assert meta[wire.META_REQUEST_ID] == "req-42"
    assert meta[wire.META_MODEL] == "llama-3-8b"
    assert meta[wire.META_PRIORITY] == 5
    kind = reply.dynamic_metadata.fields[wire.META_TOKEN_ESTIMATE].WhichOneof("kind")
    assert kind == "string_value"  # Envoy's metadata action reads strings only
    assert meta[wire.META_TOKEN_ESTIMATE] == str(101 + 2 * MESSAGE_TOKENS + 9)
    assert meta[wire.META_LIMIT_REQUESTS] == {"requests_per_unit": 100, "unit": "MINUTE"}

    after = metrics.DECISIONS.labels(result="allow", tenant="acme")._value.get()
    assert after == before + 1
    (span,) = running.spans.get_finished_spans()
    assert span.attributes is not None
    assert span.attributes["tenant.id"] == "acme"
    assert span.attributes["session.id"] == session
    assert span.attributes["llm.request.model"] == "llama-3-8b"
    assert format(span.context.trace_id, "032x") == TRACE_ID


@pytest.mark.parametrize(
    ("headers", "body", "status", "code"),
    [
        ({}, b"", 401, "invalid_api_key"),
        ({"authorization": "Bearer sk-llmgw-nope"}, CHAT, 401, "invalid_api_key"),
        ("acme", CHAT.replace(b"llama-3-8b", b"gpt-4"), 403, "model_not_allowed"),
        ("acme", b"x" * 3_000_000, 413, "request_too_large"),
        ("acme+session", CHAT, 400, "invalid_session_id"),
    ],
)
async def test_denials_over_grpc(
    running: Running, keys: Keys, headers: object, body: bytes, status: int, code: str
) -> None:
    if headers == "acme":
        headers = {"api-key": keys.acme}
    elif headers == "acme+session":
        headers = {"api-key": keys.acme, wire.HEADER_SESSION: "sess_forged"}
    assert isinstance(headers, dict)
    reply = await running.stub.Check(check_request(headers, body))
    assert reply.WhichOneof("http_response") == "denied_response"
    expected = code_pb2.UNAUTHENTICATED if status == 401 else code_pb2.PERMISSION_DENIED
    assert reply.status.code == expected
    denied = reply.denied_response
    assert denied.status.code == status
    assert header_map(denied.headers) == {"content-type": "application/json"}
    error = json.loads(denied.body)["error"]
    assert error["code"] == code
    assert error["type"] == "invalid_request_error"
    assert set(error) == {"message", "type", "code", "param"}
    assert not reply.HasField("dynamic_metadata")


async def test_revocation_and_new_keys_apply_within_two_seconds(
    running: Running, tenants_file: Path, keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    f = str(tenants_file)
    create = parser.parse_args(["keys", "create", "--tenant", "globex", "--tenants-file", f])
    revoke = parser.parse_args(["keys", "revoke", keys.acme_key_id, "--tenants-file", f])
    await asyncio.to_thread(create.func, create)
    new_key = capsys.readouterr().out.strip()
    await asyncio.to_thread(revoke.func, revoke)

    started = time.monotonic()
    old_ok = new_ok = True
    while old_ok or not new_ok:
        assert time.monotonic() - started < 2.0, "change not applied within 2 s"
        old = await running.stub.Check(check_request({"api-key": keys.acme}))
        new = await running.stub.Check(check_request({"api-key": new_key}))
        old_ok = old.status.code == code_pb2.OK
        new_ok = new.status.code == code_pb2.OK
        await asyncio.sleep(0.05)

    failed = RELOADS.labels("tenants", "failed")
    refusals = failed._value.get()
    # A broken file is refused and the last good config stays.
    await asyncio.to_thread(tenants_file.write_text, "tenants: [")
    started = time.monotonic()
    while failed._value.get() == refusals:
        assert time.monotonic() - started < 2.0, "broken file not noticed within 2 s"
        await asyncio.sleep(0.05)
    reply = await running.stub.Check(check_request({"api-key": new_key}))
    assert reply.status.code == code_pb2.OK


def picked(reply: external_auth_pb2.CheckResponse) -> str | None:
    field = reply.dynamic_metadata.fields.get(wire.DESTINATION_ENDPOINT)
    return field.string_value if field is not None else None


async def test_the_router_inside_picks_and_hears_how_the_pick_ended(
    picking: Running, router: Router, keys: Keys
) -> None:
    """The pick rides in ext_authz's metadata (override_host reads it there), counts in flight
    until its access-log entry arrives on the same server, and a denial picks nothing."""
    headers = {"api-key": keys.acme, "x-request-id": "req-pick"}
    reply = await picking.stub.Check(check_request(headers, CHAT))
    assert reply.status.code == code_pb2.OK
    pods = picked(reply)
    assert pods is not None and sorted(pods.split(",")) == PODS
    first = pods.split(",")[0]
    assert router.fleet.in_flight == {first: 1, **{p: 0 for p in PODS if p != first}}
    (span,) = [s for s in picking.spans.get_finished_spans() if s.name == "router.pick"]
    assert span.attributes is not None and span.attributes["tenant.id"] == "acme"

    await send_log(picking.logs, log_entry("req-pick", first, 200))
    assert router.fleet.in_flight == dict.fromkeys(PODS, 0)

    denied = await picking.stub.Check(check_request({"api-key": "sk-llmgw-nope"}, CHAT))
    assert denied.status.code == code_pb2.UNAUTHENTICATED
    assert picked(denied) is None and router.fleet.in_flight == dict.fromkeys(PODS, 0)


async def test_a_model_no_pod_serves_is_answered_as_vllm_would_without_a_pick(
    picking: Running, router: Router, keys: Keys
) -> None:
    """vLLM's 404 from the router's view of the fleet: the tenant's usage keeps it (the
    metadata), the aliases are what the tenant may use among what the fleet serves."""

    def ask(key: str, model: str) -> external_auth_pb2.CheckRequest:
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]})
        return check_request({"api-key": key, "x-request-id": f"req-{model}"}, body.encode())

    # acme may use mistral-7b, which no pod serves.
    reply = await picking.stub.Check(ask(keys.acme, "mistral-7b"))
    denied = reply.denied_response
    assert denied.status.code == 404 and picked(reply) is None
    assert json.loads(denied.body) == {
        "error": {
            "message": "The model `mistral-7b` does not exist. Valid aliases: llama-3-8b.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    assert json_format.MessageToDict(reply.dynamic_metadata)[wire.META_TENANT] == "acme"
    assert router.fleet.in_flight == dict.fromkeys(PODS, 0)
    # A model the tenant may not use is refused as before (403), served or not.
    reply = await picking.stub.Check(ask(keys.acme, "gpt-x"))
    assert reply.denied_response.status.code == 403
    # While a pod's list is not known, the pod answers.
    router.fleet.set_pods([*PODS, "10.0.0.3:8000"])
    reply = await picking.stub.Check(ask(keys.globex, "gpt-x"))
    assert reply.status.code == code_pb2.OK


async def test_a_router_that_raises_costs_the_pick_not_the_request(
    picking: Running, router: Router, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: object) -> None:
        raise RuntimeError("plugin bug")

    monkeypatch.setattr(router.engine, "pick", broken)
    before = metrics.PICK_ERRORS._value.get()
    reply = await picking.stub.Check(check_request({"api-key": keys.acme}, CHAT))
    assert reply.status.code == code_pb2.OK
    assert picked(reply) is None  # Envoy's fallback policy picks
    assert json_format.MessageToDict(reply.dynamic_metadata)[wire.META_TENANT] == "acme"
    assert metrics.PICK_ERRORS._value.get() == before + 1


async def test_without_a_router_inside_nothing_is_picked(running: Running, keys: Keys) -> None:
    reply = await running.stub.Check(check_request({"api-key": keys.acme}, CHAT))
    assert reply.status.code == code_pb2.OK and picked(reply) is None


def _tiers(tmp_path: Path) -> Path:
    path = tmp_path / "tiers.yaml"
    path.write_text(TIERS_YAML)
    return path


def _settings_file(tmp_path: Path, tenants_file: Path, port: int) -> Path:
    config = tmp_path / "extauthz.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "serve": {"port": port},
                "tenants_file": str(tenants_file),
                "tiers_file": str(_tiers(tmp_path)),
                "sessions": {"secret": SECRET.decode(), "worker_id": 3},
            }
        )
    )
    return config


def test_check_config(tmp_path: Path, tenants_file: Path, keys: Keys) -> None:
    good = _settings_file(tmp_path, tenants_file, 0)
    assert service_cli(["--check-config", str(good)]) == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"tenants_file": str(tenants_file), "sessions": {"secret": "x"}}))
    assert service_cli(["--check-config", str(bad)]) == 1
    _tiers(tmp_path).write_text("tiers: {}")  # the tier table lacks the tier a tenant names
    assert service_cli(["--check-config", str(good)]) == 1
    _settings_file(tmp_path, tenants_file, 0)
    # With the router inside, the router's settings file is checked too.
    router_file = tmp_path / "router.yaml"
    router_file.write_text(yaml.safe_dump({"fleet": {"pods": ["127.0.0.1:1"]}}))
    picking = tmp_path / "picking.yaml"
    held = {"topology": "rls", "router_config": str(router_file)}  # the router alone
    picking.write_text(yaml.safe_dump({**yaml.safe_load(good.read_text()), **held}))
    assert service_cli(["--check-config", str(picking)]) == 0
    router_file.write_text(yaml.safe_dump({"profile": {"picker": "no-such-plugin"}}))
    assert service_cli(["--check-config", str(picking)]) == 1
    router_file.write_text(yaml.safe_dump({"fleet": {"pods": ["no-port"]}}))  # else: exit at start
    assert service_cli(["--check-config", str(picking)]) == 1
    router_file.write_text(yaml.safe_dump({"inference_pool": {"enabled": True}}))  # ignored here
    assert service_cli(["--check-config", str(picking)]) == 1
    router_file.write_text("{}")
    assert service_cli(["--check-config", str(picking)]) == 0
    ignored = {**yaml.safe_load(picking.read_text()), "topology": "epp"}
    picking.write_text(yaml.safe_dump(ignored))  # a router_config that nothing reads
    assert service_cli(["--check-config", str(picking)]) == 1
    tenants_file.write_text("tenants: [{id: 1}]")  # the tenants file it names is checked too
    assert service_cli(["--check-config", str(good)]) == 1


def _children(pid: int) -> set[int]:
    """The processes whose parent is `pid` now (the body pool's worker, multiprocessing's
    resource tracker)."""
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    ppid = int(f.read().rpartition(b")")[2].split()[1])
            except OSError:
                continue
            if ppid == pid:
                out.add(int(entry))
    return out


def _gone(pids: set[int], within_s: float = 10.0) -> set[int]:
    """Those of `pids` still alive after waiting up to `within_s`."""
    deadline = time.monotonic() + within_s
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        alive = {p for p in alive if os.path.exists(f"/proc/{p}")}
        time.sleep(0.05)
    return alive


def _start_extauthz(tmp_path: Path, tenants_file: Path) -> tuple[Process, str]:
    port = free_port()
    target = f"127.0.0.1:{port}"
    config = _settings_file(tmp_path, tenants_file, port)
    proc = Process(
        "extauthz",
        [sys.executable, "-m", "extauthz", "--config", str(config)],
        grpc_serving(target, "extauthz"),
        tmp_path / "extauthz.log",
    )
    return proc.start(timeout=30), target


def test_python_m_extauthz_serves_and_exits_0_on_sigterm(
    tmp_path: Path, tenants_file: Path, keys: Keys
) -> None:
    proc, target = _start_extauthz(tmp_path, tenants_file)
    assert proc.pid is not None
    workers = _children(proc.pid)
    assert workers  # the body pool starts with the service
    try:
        with grpc.insecure_channel(target) as channel:
            reply = Stub(channel).Check(check_request({"api-key": keys.acme}, CHAT), timeout=5)
        assert reply.status.code == code_pb2.OK
        session = json_format.MessageToDict(reply.dynamic_metadata)[wire.META_SESSION]
        assert session.startswith("sess_")
    finally:
        code = proc.stop()
    assert code == 0, proc.log_tail()
    assert keys.acme not in (tmp_path / "extauthz.log").read_text()
    assert not _gone(workers), "body-pool processes outlived extauthz"


def test_no_body_pool_process_outlives_a_killed_extauthz(
    tmp_path: Path, tenants_file: Path, keys: Keys
) -> None:
    proc, _ = _start_extauthz(tmp_path, tenants_file)  # `keys` writes the tenants file
    assert proc.pid is not None
    workers = _children(proc.pid)
    assert workers
    os.kill(proc.pid, signal.SIGKILL)
    proc.stop()
    assert not _gone(workers), "body-pool processes outlived a SIGKILLed extauthz"


def _check_headers(key: str) -> dict[str, str]:
    return {":method": "POST", ":path": wire.CHAT_PATH, "api-key": key}


async def test_a_strangers_body_is_never_read(
    pooled: tuple[Director, BodyPool], keys: Keys
) -> None:
    service, _ = pooled
    before = metrics.POOLED_BODIES._value.get()
    answer = await service.check(_check_headers("sk-llmgw-nope"), CHAT)
    assert answer.status == 401
    assert metrics.POOLED_BODIES._value.get() == before  # the key first, from the headers
    assert (await service.check(_check_headers(keys.acme), CHAT)).status == 200
    assert metrics.POOLED_BODIES._value.get() == before + 1


async def test_a_killed_pool_worker_is_replaced_at_once(
    pooled: tuple[Director, BodyPool], keys: Keys
) -> None:
    service, pool = pooled
    kill_worker(pool)
    restarts = metrics.POOL_RESTARTS._value.get()
    assert (await service.check(_check_headers(keys.acme), CHAT)).status == 200
    assert metrics.POOL_RESTARTS._value.get() == restarts + 1
    assert pool.healthy and service.healthy
    assert (await service.check(_check_headers(keys.acme), CHAT)).status == 200


@pytest.mark.parametrize(
    ("offset_s", "waited_s", "shed"),
    [
        (0.0, 1.2, True),
        (0.0, 0.1, False),
        (0.0, -5.0, False),  # a stamp from the future: no wait
        (0.0, 3600.0, False),  # an hour: clocks apart, not a wait
        (-5.0, 1.2, True),  # Envoy's clock 5 s behind this one's: the wait still counts
        (5.0, 0.1, False),  # ... or ahead
    ],
)
async def test_a_check_that_waited_too_long_is_shed_before_anything_else(
    pooled: tuple[Director, BodyPool],
    keys: Keys,
    offset_s: float,
    waited_s: float,
    shed: bool,
) -> None:
    """A check whose body Envoy had more than shed_after_ms ago is answered 503 overloaded with
    retry-after, before its key is even looked up; a fresh one is decided. Envoy's clock may be
    another host's: the wait is measured net of the offset a check that did not wait shows."""
    service, _ = pooled

    def stamped(ago_s: float) -> dict[str, str]:
        stamp = str(int((time.time() + offset_s - ago_s) * 1000))
        return {**_check_headers(keys.acme), authzhttp.BODY_AT: stamp}

    assert (await service.check(stamped(0.0), CHAT)).status == 200  # no wait: the offset
    answer = await service.check(stamped(waited_s), CHAT)
    if shed:
        assert answer.status == 503
        assert json.loads(answer.body)["error"]["code"] == "overloaded"
        assert ("retry-after", "1") in answer.client_headers
    else:
        assert answer.status == 200
