"""The check over HTTP (extauthz/httpserver.py): the requests Envoy's ext_authz `http_service`
sends, over a real socket; the same answer as over gRPC; framing that tries to break it."""

from __future__ import annotations

import asyncio
import collections
import copy
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import yaml
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider

from extauthz import metrics
from extauthz.answers import Answer
from extauthz.bodypool import BodyPool
from extauthz.budget import BodyBudget, Held
from extauthz.director import Director
from extauthz.httpserver import MAX_HEAD_BYTES, HttpCheckServer, encode
from extauthz.service import check_response
from extauthz.store import tenants_store
from llmgw import authzhttp, wire
from llmgw.structs import to_dict
from tests.extauthz.conftest import SECRET, Keys, kill_worker, make_decider
from tests.extauthz.test_service import CHAT
from tests.recording_pod import recording_pod
from tools import envoyconf
from tools.envoyconf import Address, EnvoySettings, Health, Services
from tools.procs import Process, bin_path, free_port, grpc_serving, http_ok


class Response:
    def __init__(self, head: bytes, body: bytes) -> None:
        line, *fields = head.decode("latin-1").split("\r\n")
        self.status = int(line.split(" ")[1])
        self.headers: list[tuple[str, str]] = []
        for f in fields:
            name, _, value = f.partition(":")
            self.headers.append((name.lower(), value.strip()))
        self.body = body

    def get(self, name: str) -> str | None:
        found = [v for k, v in self.headers if k == name]
        assert len(found) <= 1, f"{name} sent {len(found)} times"
        return found[0] if found else None


async def read_response(reader: asyncio.StreamReader) -> Response:
    head = (await reader.readuntil(b"\r\n\r\n"))[:-4]
    length = int(Response(head, b"").get("content-length") or 0)
    return Response(head, await reader.readexactly(length))


def request(
    headers: Mapping[str, str], body: bytes = b"", path: str = wire.CHAT_PATH, method: str = "POST"
) -> bytes:
    """As Envoy's HTTP client sends a check: the client's method and path, a content-length."""
    lines = [f"{method} {path} HTTP/1.1", "host: gateway", f"content-length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class Fake:
    """A check that answers what it is told to, after `delay_s`; or raises."""

    def __init__(self) -> None:
        self.seen: list[tuple[dict[str, str], bytes]] = []
        self.arrived = asyncio.Event()
        self.delay_s = 0.0
        self.fail = False
        self.cancelled = 0
        self.healthy = True
        self.gate = asyncio.Event()  # cleared: checks wait until it is set
        self.gate.set()

    def receive(self, headers: Mapping[str, str], length: int) -> Answer | Held:
        return Held(BodyBudget(0, 0), "", 0)

    def key(self, headers: Mapping[str, str]) -> Answer:
        return Answer(200, {}, [(wire.HEADER_TENANT, "acme")])

    async def check(self, headers: Mapping[str, str], body: bytes, *, held: Held) -> Answer:
        self.seen.append((dict(headers), body))
        self.arrived.set()
        try:
            await self.gate.wait()
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if self.fail:
            raise RuntimeError("bug")
        return Answer(200, {wire.META_TENANT: headers.get(":path", "")}, [])


async def served(
    service: Any, max_body: int = 1 << 20
) -> AsyncIterator[tuple[HttpCheckServer, int]]:
    server = HttpCheckServer(service, max_body)
    port = await server.start("127.0.0.1", 0)
    try:
        yield server, port
    finally:
        await server.stop(0.5)


@pytest.fixture
async def fake() -> AsyncIterator[tuple[Fake, int]]:
    service = Fake()
    async for _, port in served(service):
        yield service, port


@pytest.fixture
async def real(
    tenants_file: Path, tiers_file: Path, keys: Keys
) -> AsyncIterator[tuple[Director, int]]:
    store = tenants_store(tenants_file, tiers_file)
    service = Director(store, make_decider(), TracerProvider().get_tracer("test"))
    async for _, port in served(service):
        yield service, port


async def exchange(port: int, data: bytes) -> Response:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        return await read_response(reader)
    finally:
        writer.close()


async def test_allow_over_http(real: tuple[Director, int], keys: Keys) -> None:
    _, port = real
    headers = {
        "authorization": f"Bearer {keys.acme}",
        "x-request-id": "req-42",
        wire.HEADER_TENANT: "globex",  # forged: replaced
        "x-llmgw-forged": "1",  # forged, not ours: removed
    }
    reply = await exchange(port, request(headers, CHAT))
    assert reply.status == 200
    assert reply.get(wire.HEADER_TENANT) == "acme"
    assert reply.get(wire.HEADER_REQUEST_ID) == "req-42"
    removed = (reply.get(authzhttp.HEADERS_TO_REMOVE) or "").split(",")
    assert sorted(removed) == ["authorization", "x-llmgw-forged"]
    # One header, which Envoy puts both on the request to the pod and on the response.
    assert (reply.get(wire.HEADER_SESSION) or "").startswith("sess_")
    assert reply.get(wire.META_TENANT) == "acme"
    assert reply.get(wire.META_PRIORITY) == "5"
    assert reply.get(wire.META_STREAM) == "false"
    assert reply.get(wire.META_LIMIT_REQUESTS) is None  # a struct: for the rate-limit filter only


async def test_denial_over_http(real: tuple[Director, int]) -> None:
    _, port = real
    reply = await exchange(port, request({"authorization": "Bearer sk-llmgw-nope"}, CHAT))
    assert reply.status == 401
    assert reply.get("content-type") == "application/json"
    assert json.loads(reply.body)["error"]["code"] == "invalid_api_key"


async def test_same_answer_as_grpc(real: tuple[Director, int], keys: Keys) -> None:
    """The contract: what Envoy makes of the HTTP answer (headers by name, metadata from
    headers, read back typed) is what it makes of the gRPC one."""
    service, _ = real
    headers = {
        ":method": "POST",
        ":path": wire.CHAT_PATH,
        "authorization": f"Bearer {keys.acme}",
        "x-request-id": "req-1",
        wire.HEADER_SESSION: "",
    }
    body = json.dumps(
        {"model": "llama-3-8b", "messages": [{"role": "user", "content": "x"}], "stream": True}
    ).encode()
    answer = await service.check(headers, body)
    grpc_meta = to_dict(check_response(answer).dynamic_metadata)
    reply = Response(*encode(answer).split(b"\r\n\r\n", 1))
    http_meta = {k: v for k, v in reply.headers if k in authzhttp.METADATA}
    typed = dict(authzhttp.Typed(http_meta))
    structs = {k for k, v in grpc_meta.items() if isinstance(v, dict)}
    assert structs == {wire.META_LIMIT_REQUESTS}
    assert typed == {k: v for k, v in grpc_meta.items() if k not in structs}
    assert set(grpc_meta) - structs <= authzhttp.METADATA  # no key Envoy would not take


def test_breaker_refusal_is_sent_as_429() -> None:
    answer = Answer(503, {wire.META_CIRCUIT_OPEN: True}, [("retry-after", "3")], body=b"{}")
    reply = Response(*encode(answer).split(b"\r\n\r\n", 1))
    assert reply.status == 429  # Envoy would take a 503 for extauthz failing
    assert reply.get(wire.META_CIRCUIT_OPEN) == "true"
    assert reply.get(wire.META_STATUS) == "503"  # the status meant, for Envoy to restore
    assert reply.get("retry-after") == "3"


def test_no_value_ends_a_header_line() -> None:
    hostile = "m\r\nx-llmgw-tenant: evil\r\n\r\nHTTP/1.1 200 OK\u2028é\0"
    answer = Answer(200, {wire.META_MODEL: hostile}, [(wire.HEADER_SESSION, hostile)])
    head, body = encode(answer).split(b"\r\n\r\n", 1)
    assert body == b""
    reply = Response(head, body)
    assert reply.get(wire.HEADER_TENANT) is None
    assert reply.get(wire.META_MODEL) == reply.get(wire.HEADER_SESSION)
    value = reply.get(wire.META_MODEL) or ""
    assert value.isascii() and value.isprintable()
    assert json.loads(f'"{value}"') == hostile  # JSON's escapes, readable back


def test_typed_reads_strings_and_typed_values() -> None:
    meta = authzhttp.Typed(
        {
            wire.META_STREAM: "true",
            wire.META_FIRST_TURN: False,
            wire.META_PRIORITY: "7",
            wire.META_CHOICES: 2.0,
            wire.META_MAX_OUTPUT: "lots",
            wire.META_TOKEN_ESTIMATE: "41",
        }
    )
    assert meta[wire.META_STREAM] is True
    assert meta[wire.META_FIRST_TURN] is False
    assert meta[wire.META_PRIORITY] == 7.0
    assert meta[wire.META_CHOICES] == 2.0
    assert meta.get(wire.META_MAX_OUTPUT) is None  # not a number: missing
    assert meta[wire.META_TOKEN_ESTIMATE] == "41"  # a string in the contract


async def test_requests_in_pieces_and_back_to_back(fake: tuple[Fake, int]) -> None:
    service, port = fake
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = b'{"a": "' + b"x" * 200_000 + b'"}'
    one = request({}, body, path="/one")
    for i in range(0, 300):  # the head a byte at a time, then the body in large pieces
        writer.write(one[i : i + 1])
        await writer.drain()
    writer.write(one[300:150_000])
    await asyncio.sleep(0.01)
    writer.write(one[150_000:] + request({}, b"{}", path="/two") + request({}, path="/three"))
    replies = [await read_response(reader) for _ in range(3)]
    writer.close()
    assert [r.get(wire.META_TENANT) for r in replies] == ["/one", "/two", "/three"]
    assert [b for _, b in service.seen] == [body, b"{}", b""]
    assert service.seen[0][0][":method"] == "POST"


async def test_repeated_header_joined(fake: tuple[Fake, int]) -> None:
    service, port = fake
    data = request({}).replace(b"\r\n\r\n", b"\r\nX-A: 1\r\nx-a: 2\r\n\r\n")
    await exchange(port, data)
    assert service.seen[0][0]["x-a"] == "1,2"


@pytest.mark.parametrize(
    ("data", "status", "cause"),
    [
        (b"GARBAGE\r\n\r\n", 400, "malformed"),
        (b"POST / HTTP/1.0\r\ncontent-length: 0\r\n\r\n", 505, "malformed"),
        (b"POST / HTTP/1.1\r\nno-colon\r\n\r\n", 400, "malformed"),
        (b"POST / HTTP/1.1\r\ncontent-length: -1\r\n\r\n", 400, "malformed"),
        (b"POST / HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n", 501, "malformed"),
        (b"POST / HTTP/1.1\r\ncontent-length: 99999999999\r\n\r\n", 413, "too_large"),
        (b"POST / HTTP/1.1\r\nx: " + b"y" * 200_000, 431, "too_large"),
    ],
)
async def test_malformed_refused_and_closed(
    fake: tuple[Fake, int], data: bytes, status: int, cause: str
) -> None:
    service, port = fake
    before = metrics.HTTP_ERRORS.labels(cause=cause)._value.get()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    reply = await read_response(reader)
    assert reply.status == status
    assert await reader.read() == b""  # closed
    writer.close()
    assert service.seen == []
    assert metrics.HTTP_ERRORS.labels(cause=cause)._value.get() == before + 1


async def test_a_check_that_raises_is_a_500_and_the_server_goes_on(fake: tuple[Fake, int]) -> None:
    service, port = fake
    service.fail = True
    assert (await exchange(port, request({}))).status == 500  # Envoy fails it closed
    service.fail = False
    assert (await exchange(port, request({}))).status == 200


async def test_a_connection_buffers_at_most_a_head_ahead() -> None:
    """Bytes after a request whose check runs (Envoy sends none) are not read on without end:
    the connection stops reading until its answer, then reads on."""
    service = Fake()
    service.gate.clear()
    server = HttpCheckServer(service)
    port = await server.start("127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request({}, path="/one") + request({}, b"y" * (4 << 20), path="/two"))
        await asyncio.wait_for(service.arrived.wait(), 10)
        (conn,) = server.connections
        assert conn.transport is not None
        for _ in range(500):  # a bound against a hang, not a speed
            if not conn.transport.is_reading():
                break
            await asyncio.sleep(0.01)
        assert not conn.transport.is_reading()
        assert len(conn.buffer) < MAX_HEAD_BYTES + (1 << 20)  # a head, and one read at most
        service.gate.set()
        replies = [await asyncio.wait_for(read_response(reader), 10) for _ in range(2)]
        assert [r.get(wire.META_TENANT) for r in replies] == ["/one", "/two"]
    finally:
        writer.close()
        await server.stop(0.5)


async def test_envoy_hanging_up_cancels_the_check(fake: tuple[Fake, int]) -> None:
    service, port = fake
    service.delay_s = 30
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request({}))
    await writer.drain()
    await asyncio.wait_for(service.arrived.wait(), 5)
    writer.close()
    for _ in range(100):
        if service.cancelled:
            break
        await asyncio.sleep(0.01)
    assert service.cancelled == 1


async def test_stop_answers_checks_in_flight_and_closes_idle_connections() -> None:
    service = Fake()
    server = HttpCheckServer(service)
    port = await server.start("127.0.0.1", 0)
    idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)
    idle_writer.write(request({}))
    await read_response(idle_reader)
    service.delay_s = 0.3
    busy_reader, busy_writer = await asyncio.open_connection("127.0.0.1", port)
    service.arrived.clear()
    busy_writer.write(request({}))
    await busy_writer.drain()
    await asyncio.wait_for(service.arrived.wait(), 5)
    await asyncio.wait_for(server.stop(5.0), 3.0)
    assert await idle_reader.read() == b""
    assert (await read_response(busy_reader)).status == 200  # answered, then closed
    assert await busy_reader.read() == b""
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)
    idle_writer.close()
    busy_writer.close()


async def test_health_path_answers_until_drained() -> None:
    service = Fake()
    server = HttpCheckServer(service)
    port = await server.start("127.0.0.1", 0)
    health = request({}, path=authzhttp.HEALTH_PATH, method="GET")
    try:
        assert (await exchange(port, health)).status == authzhttp.HEALTHY
        assert (await exchange(port, request({}))).get(authzhttp.IMMEDIATE_FAIL) is None
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # idle: kept open
        server.drain()
        assert (await exchange(port, health)).status == 503
        writer.write(request({}))
        reply = await read_response(reader)
        assert reply.status == 200  # still answered, and its connection closed after it
        assert reply.get("connection") == "close"
        assert reply.get(authzhttp.IMMEDIATE_FAIL) == "true"  # Envoy fails the host at once
        assert await reader.read() == b""
        writer.close()
        assert len(service.seen) == 2  # the health path is not a check
    finally:
        await server.stop(0.5)


async def test_a_replica_that_stops_under_load_fails_no_check(tmp_path: Path) -> None:
    """Two replicas behind the real Envoy with the template's check cluster; one drains and
    stops under load. Envoy's health check takes it out before it closes, and no check is sent
    on a connection it closes: every request is answered."""
    port = free_port()
    services = [Fake(), Fake()]
    replicas = [HttpCheckServer(service, drain_s=1.0) for service in services]
    for host, replica in zip(("127.0.0.1", "127.0.0.2"), replicas, strict=True):
        await replica.start(host, port)
    with recording_pod() as pod:
        where = Services(
            extauthz=Address(port=free_port()),  # gRPC: unused without router or ledger
            extauthz_http=Address(port=port),
        )
        admin = Address(port=free_port())
        settings = EnvoySettings(
            admin=admin, concurrency=1, health=Health(interval="0.25s", timeout="0.5s")
        )
        listen = Address(port=free_port())
        host, pod_port = pod.address.split(":")
        config = yaml.safe_load(
            envoyconf.render(settings, listen, [Address(host=host, port=int(pod_port))], where)
        )
        for cluster in config["static_resources"]["clusters"]:
            if cluster["name"] not in ("extauthz_http", "extauthz_keys"):  # checks, key questions
                continue
            (endpoints,) = cluster["load_assignment"]["endpoints"]
            second = copy.deepcopy(endpoints["lb_endpoints"][0])
            second["endpoint"]["address"]["socket_address"]["address"] = "127.0.0.2"
            endpoints["lb_endpoints"].append(second)
        path = tmp_path / "envoy.json"  # JSON: a YAML dump would leave the key `n` a boolean
        path.write_text(json.dumps(config))
        argv = [bin_path("envoy"), "-c", str(path), "--disable-hot-restart", "--concurrency", "1"]
        argv += ["--base-id", str(admin.port)]
        envoy = Process(
            "envoy", argv, http_ok(f"http://127.0.0.1:{admin.port}/ready"), tmp_path / "envoy.log"
        )
        await asyncio.to_thread(envoy.start, 30)
        try:
            statuses = await _load_while(
                f"http://127.0.0.1:{listen.port}{wire.CHAT_PATH}", replicas[0]
            )
        finally:
            envoy.stop()
            await replicas[1].stop(0.5)
    assert len(statuses) > 200
    assert set(statuses) == {200}, collections.Counter(statuses)
    assert all(len(service.seen) > 20 for service in services)  # both served


async def _load_while(url: str, stopping: HttpCheckServer) -> list[int]:
    """Requests at 16 at a time; after 1 s, `stopping` drains and stops at once, as at a SIGTERM
    with no gRPC call to wait for (its own drain time holds the port open), then 1 s more."""
    statuses: list[int] = []
    done = asyncio.Event()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    headers = {"authorization": f"Bearer {wire.KEY_PREFIX}x"}
    async with aiohttp.ClientSession(headers=headers) as session:

        async def client() -> None:
            while not done.is_set():
                async with session.post(url, json=body) as reply:
                    await reply.read()
                    statuses.append(reply.status)

        clients = [asyncio.create_task(client()) for _ in range(16)]
        await asyncio.sleep(1.0)
        await stopping.stop(1.0)
        await asyncio.sleep(1.0)
        done.set()
        await asyncio.gather(*clients)
    return statuses


async def test_sigterm_drains_the_check_port_before_it_closes(
    tmp_path: Path, tenants_file: Path, tiers_file: Path, keys: Keys
) -> None:
    """`python -m extauthz` holding the router, with Envoy's router access-log stream open (so
    gRPC's stop waits out its grace): at SIGTERM the check port drains at once (health 503)
    and closes only after its own drain time, then the process exits 0."""
    port, http_port = free_port(), free_port()
    config = tmp_path / "extauthz.yaml"
    settings = {
        "serve": {"port": port, "grace_seconds": 2.0},
        "http_port": http_port,
        "http_drain_seconds": 1.0,
        "topology": "rls",  # the router alone
        "tenants_file": str(tenants_file),
        "tiers_file": str(tiers_file),
        "sessions": {"secret": SECRET.decode(), "worker_id": 3},
    }
    config.write_text(yaml.safe_dump(settings))
    env = {**os.environ, "LLMGW_ROUTER__FLEET__PODS": '["127.0.0.1:9"]'}
    argv = [sys.executable, "-m", "extauthz", "--config", str(config)]
    target = f"127.0.0.1:{port}"
    proc = Process("extauthz", argv, grpc_serving(target, "extauthz"), tmp_path / "log", env)
    await asyncio.to_thread(proc.start, 30)
    health = request({}, path=authzhttp.HEALTH_PATH, method="GET")
    held = asyncio.Event()

    async def logs() -> AsyncIterator[als_pb2.StreamAccessLogsMessage]:
        yield als_pb2.StreamAccessLogsMessage()
        await held.wait()

    try:
        assert (await exchange(http_port, health)).status == authzhttp.HEALTHY
        async with grpc.aio.insecure_channel(target) as channel:
            stream = als_pb2_grpc.AccessLogServiceStub(channel).StreamAccessLogs(logs())
            await asyncio.sleep(0.2)  # the stream is open on the server
            assert proc.pid is not None
            os.kill(proc.pid, signal.SIGTERM)
            signalled = time.monotonic()
            statuses: list[tuple[float, int]] = []
            for _ in range(200):  # bounded: 10 s
                try:
                    status = (await exchange(http_port, health)).status
                except (OSError, asyncio.IncompleteReadError):  # refused, or accepted as it closed
                    break
                statuses.append((time.monotonic() - signalled, status))
                await asyncio.sleep(0.05)
            closed = time.monotonic() - signalled
            held.set()
            stream.cancel()
        first_503 = next(t for t, status in statuses if status == 503)
        assert first_503 < 0.5, statuses  # at SIGTERM, not after gRPC's grace
        assert {status for _, status in statuses} <= {authzhttp.HEALTHY, 503}
        assert closed >= 1.0, statuses  # open for its drain time at least
        assert await asyncio.to_thread(proc.stop) == 0, proc.log_tail()
    finally:
        proc.stop()


async def test_health_fails_while_the_pool_cannot_be_replaced(
    pooled: tuple[Director, BodyPool], keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    service, pool = pooled
    server = HttpCheckServer(service)
    port = await server.start("127.0.0.1", 0)
    health = request({}, path=authzhttp.HEALTH_PATH, method="GET")
    acme = {"api-key": keys.acme}
    try:
        assert (await exchange(port, health)).status == authzhttp.HEALTHY

        def no_process() -> None:
            raise OSError(12, "Cannot allocate memory")

        monkeypatch.setattr(pool, "_new_executor", no_process)
        kill_worker(pool)
        reply = await exchange(port, request(acme, CHAT))
        assert reply.status == 429 and reply.get(wire.META_STATUS) == "503"
        assert json.loads(reply.body)["error"]["code"] == "overloaded"
        assert not service.healthy
        assert (await exchange(port, health)).status == 503

        monkeypatch.undo()  # processes can be started again: the next large body replaces it
        assert (await exchange(port, request(acme, CHAT))).status == 200
        assert (await exchange(port, health)).status == authzhttp.HEALTHY
    finally:
        await server.stop(0.5)
