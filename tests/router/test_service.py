"""The ext_proc and access-log servicers over real gRPC, with messages as Envoy fills them."""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from envoy.config.core.v3 import address_pb2, base_pb2
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf.json_format import MessageToDict
from opentelemetry import trace

from llmgw import facts, wire
from router.collectors.resolver import Resolver
from router.collectors.scraper import Scraper
from router.engine import Engine
from router.fleet import Fleet, FleetSettings
from router.plugins.prefix_affinity import PrefixAffinity
from router.registry import DEFAULT_PLUGINS, DEFAULT_PROFILE, default_registry
from router.runtime import Router
from router.service import RouterService
from router.types import PodMetrics
from tests.router.conftest import FakePod, metrics_text
from tools import procs

Served = tuple[RouterService, pb_grpc.ExternalProcessorStub, als_pb2_grpc.AccessLogServiceStub]
Starter = Callable[[Fleet], Awaitable[Served]]
TRACEPARENT = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"


REQUEST_IDS = itertools.count()


def headers_msg(
    meta: dict[str, object] | None = None,
    headers: dict[str, str] | None = None,
    request_id: str | None = None,
) -> pb.ProcessingRequest:
    """The one message Envoy sends: request headers plus extauthz's forwarded metadata."""
    values = {
        ":method": "POST",
        ":path": "/v1/chat/completions",
        wire.HEADER_REQUEST_ID: request_id or f"req-{next(REQUEST_IDS)}",
        **(headers or {}),
    }
    msg = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[
                    base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()
                ]
            ),
            end_of_stream=True,
        )
    )
    if meta is not None:
        msg.metadata_context.filter_metadata[wire.EXTAUTHZ_NAMESPACE].update(meta)
    return msg


def log_entry(
    request_id: str, answered: str | None, status: int
) -> accesslog_pb2.HTTPAccessLogEntry:
    entry = accesslog_pb2.HTTPAccessLogEntry()
    entry.request.request_id = request_id
    if answered is not None:
        host, port = answered.split(":")
        entry.common_properties.upstream_remote_address.CopyFrom(
            address_pb2.Address(
                socket_address=address_pb2.SocketAddress(address=host, port_value=int(port))
            )
        )
    entry.response.response_code.value = status
    return entry


async def send_log(
    stub: als_pb2_grpc.AccessLogServiceStub, *entries: accesslog_pb2.HTTPAccessLogEntry
) -> None:
    message = als_pb2.StreamAccessLogsMessage()
    message.http_logs.log_entry.extend(entries)

    async def one() -> AsyncIterator[als_pb2.StreamAccessLogsMessage]:
        yield message

    await stub.StreamAccessLogs(one())


def destination(resp: pb.ProcessingResponse) -> str | None:
    meta = MessageToDict(resp.dynamic_metadata)
    dest = meta.get(wire.LB_NAMESPACE, {}).get(wire.DESTINATION_ENDPOINT)
    return str(dest) if dest is not None else None


def make_fleet(pods: list[str], **settings: Any) -> Fleet:
    fleet = Fleet(FleetSettings(capacity=10, stale_after=60, **settings))
    fleet.set_pods(pods)
    for pod in pods:
        fleet.snapshots[pod] = PodMetrics(pod, fleet.clock(), ok=True, models=frozenset({"m"}))
    return fleet


@pytest.fixture
async def serve() -> AsyncIterator[Starter]:
    servers: list[grpc.aio.Server] = []
    channels: list[grpc.aio.Channel] = []

    async def start(fleet: Fleet) -> Served:
        engine = Engine(default_registry().build(DEFAULT_PLUGINS, DEFAULT_PROFILE))
        router = Router(fleet, engine, trace.get_tracer("test"))
        service = RouterService(router)
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_ExternalProcessorServicer_to_server(service, server)
        router.register(server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        servers.append(server)
        channels.append(channel)
        return (
            service,
            pb_grpc.ExternalProcessorStub(channel),
            als_pb2_grpc.AccessLogServiceStub(channel),
        )

    yield start
    for channel in channels:
        await channel.close(None)
    for server in servers:
        await server.stop(None)


async def test_one_message_picks_and_the_access_log_releases(serve: Starter) -> None:
    fleet = make_fleet(["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"])
    fleet.snapshots["10.0.0.1:8000"] = PodMetrics(
        "10.0.0.1:8000", fleet.clock(), ok=True, running=9, kv_usage=0.9
    )
    _, stub, log = await serve(fleet)
    call = stub.Process()
    await call.write(
        headers_msg({wire.META_TENANT: "acme"}, {"traceparent": TRACEPARENT}, request_id="a")
    )
    resp = await call.read()
    assert resp.WhichOneof("response") == "request_headers"
    dest = destination(resp)
    assert dest is not None
    listed = dest.split(",")
    assert 1 < len(listed) <= 3 and listed[0] != "10.0.0.1:8000"
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK
    # In flight until the outcome arrives, batched, from the access log.
    assert fleet.in_flight[listed[0]] == 1
    await send_log(log, log_entry("a", listed[0], 200))
    assert sum(fleet.in_flight.values()) == 0


async def test_a_pick_envoy_never_used_stops_counting_after_its_ttl(serve: Starter) -> None:
    """The client left during the pick: no outcome will name it; the count must not stay."""
    now = [1000.0]
    fleet = make_fleet(["10.0.0.1:8000"], in_flight_ttl=60)
    fleet.clock = lambda: now[0]
    _, stub, log = await serve(fleet)
    for rid in ("gone", "late"):
        call = stub.Process()
        await call.write(headers_msg(request_id=rid))
        await call.read()
        await call.done_writing()
    assert fleet.in_flight["10.0.0.1:8000"] == 2
    await send_log(log, log_entry("unknown", "10.0.0.1:8000", 200))  # not ours: no effect
    assert fleet.in_flight["10.0.0.1:8000"] == 2
    now[0] += 61
    call = stub.Process()
    await call.write(headers_msg(request_id="next"))  # any pick sweeps the expired ones
    await call.read()
    await call.done_writing()
    assert fleet.in_flight["10.0.0.1:8000"] == 1


async def test_the_outcome_reports_the_pods_status(serve: Starter) -> None:
    fleet = make_fleet(["10.0.0.1:8000"], error_threshold=1)
    _, stub, log = await serve(fleet)
    call = stub.Process()
    await call.write(headers_msg(request_id="b"))
    assert destination(await call.read()) == "10.0.0.1:8000"
    await call.done_writing()
    assert fleet.in_flight["10.0.0.1:8000"] == 1
    await send_log(log, log_entry("b", "10.0.0.1:8000", 503))
    assert fleet.in_flight["10.0.0.1:8000"] == 0
    assert not fleet.candidates()[0].healthy  # one 5xx reaches the threshold of 1


async def test_a_pick_envoy_retried_elsewhere_counts_as_a_failure(serve: Starter) -> None:
    fleet = make_fleet(["10.0.0.1:8000", "10.0.0.2:8000"], error_threshold=1)
    _, stub, log = await serve(fleet)
    call = stub.Process()
    await call.write(headers_msg(request_id="c"))
    picked = (destination(await call.read()) or "").split(",")[0]
    await call.done_writing()
    other = next(p for p in fleet.snapshots if p != picked)
    await send_log(log, log_entry("c", other, 200))
    healthy = {c.pod: c.healthy for c in fleet.candidates()}
    assert healthy == {picked: False, other: True}
    assert fleet.in_flight[picked] == 0


async def test_forwarded_facts_give_model_and_prefix(serve: Starter) -> None:
    fleet = make_fleet(["10.0.0.1:8000", "10.0.0.2:8000"])
    fleet.snapshots["10.0.0.2:8000"] = PodMetrics(
        "10.0.0.2:8000", fleet.clock(), ok=True, models=frozenset({"big"})
    )
    _, stub, _ = await serve(fleet)
    body = {"model": "big", "messages": [{"role": "user", "content": "hello " * 100}]}
    request_facts = facts.from_body(
        body, chars_per_token=4, image_tokens=0, max_output=16, max_blocks=64, model="big"
    )
    assert request_facts.prefix_blocks
    call = stub.Process()
    await call.write(headers_msg(dict(request_facts.to_metadata())))
    reply = await call.read()
    assert reply.WhichOneof("response") == "request_headers"
    assert destination(reply) == "10.0.0.2:8000"  # the only pod serving "big"
    await call.done_writing()
    assert await call.code() == grpc.StatusCode.OK


async def test_only_an_answered_pick_teaches_the_prefix_index(serve: Starter) -> None:
    """Inside extauthz the pick precedes the rate limiter: a refused request (no pod answered),
    or one its pod failed, must not make the router believe that pod caches its prompt (a
    tenant over its limit could rewrite every pod's index for free). An answered one does, on
    the pod that answered it."""
    fleet = make_fleet(["10.0.0.1:8000", "10.0.0.2:8000"])
    service, stub, log = await serve(fleet)
    (index,) = [
        s.index for s, _ in service.router.engine.profile.scorers if isinstance(s, PrefixAffinity)
    ]
    body = {"model": "m", "messages": [{"role": "system", "content": "policy " * 400}]}
    request_facts = facts.from_body(
        body, chars_per_token=4, image_tokens=0, max_output=16, max_blocks=64, model="m"
    )
    blocks = request_facts.prefix_blocks
    assert len(blocks) > 32

    async def pick(request_id: str) -> str:
        call = stub.Process()
        await call.write(headers_msg(dict(request_facts.to_metadata()), request_id=request_id))
        picked = (destination(await call.read()) or "").split(",")[0]
        await call.done_writing()
        return picked

    refused, failed = await pick("refused"), await pick("failed")
    await send_log(log, log_entry("refused", None, 429), log_entry("failed", failed, 503))
    served = await pick("served")
    assert index.match(blocks) == {}  # nothing served yet
    other = next(p for p in fleet.snapshots if p != served)
    await send_log(log, log_entry("served", other, 200))  # Envoy retried it on the other pod
    assert index.match(blocks) == {other: len(blocks)}
    assert refused and fleet.in_flight == dict.fromkeys(fleet.snapshots, 0)


async def test_no_pod_left_answers_without_metadata(serve: Starter) -> None:
    fleet = make_fleet(["10.0.0.1:8000"])
    _, stub, _ = await serve(fleet)
    call = stub.Process()
    await call.write(headers_msg({wire.META_MODEL: "unknown-model"}))
    resp = await call.read()
    assert resp.WhichOneof("response") == "request_headers"
    assert not resp.HasField("dynamic_metadata")
    await call.done_writing()
    assert await call.code() == grpc.StatusCode.OK


async def test_two_replicas_keep_a_session_on_one_pod(
    serve: Starter, fake_pods: list[FakePod]
) -> None:
    for i, pod in enumerate(fake_pods):
        pod.text = metrics_text(running=i % 2, kv=0.1)
    stubs = []
    fleets = []
    async with aiohttp.ClientSession() as session:
        for _ in range(2):
            # Both replicas keep the one scrape's view for the whole test: with the default
            # stale_after (0.5 s), a busy machine aged the first replica's view out before the
            # second's, and the replicas no longer saw the same fleet.
            pods = [p.pod for p in fake_pods]
            fleet = Fleet(FleetSettings(pods=pods, scrape_timeout=1.0, stale_after=600))
            fleet.set_pods(await Resolver(fleet).resolve())
            await Scraper(fleet).scrape_once(session)
            fleets.append(fleet)
            stubs.append((await serve(fleet))[1:])
    for n in range(20):
        session_id = f"sess_{n}"
        firsts = []
        for turn in range(3):
            stub, log = stubs[turn % 2]  # turns alternate between the replicas
            call = stub.Process()
            rid = f"{session_id}-{turn}"
            await call.write(headers_msg({wire.META_SESSION: session_id}, request_id=rid))
            dest = destination(await call.read())
            assert dest is not None
            firsts.append(dest.split(",")[0])
            await call.done_writing()
            assert await call.code() == grpc.StatusCode.OK
            await send_log(log, log_entry(rid, firsts[-1], 200))  # the turn ended
        assert len(set(firsts)) == 1, (session_id, firsts)


async def test_subprocess_serves_picks_and_exits_0_on_sigterm(
    tmp_path: Path, fake_pods: list[FakePod]
) -> None:
    port = procs.free_port()
    config = tmp_path / "router.yaml"
    config.write_text(
        f"fleet:\n  pods: [{fake_pods[0].pod!r}]\n  scrape_interval: 0.05\n  scrape_timeout: 0.5\n"
    )
    env = {**os.environ, "LLMGW_ROUTER__SERVE__PORT": str(port)}
    proc = procs.Process(
        "router",
        [sys.executable, "-m", "router", "--config", str(config)],
        procs.grpc_serving(f"127.0.0.1:{port}", "router"),
        tmp_path / "router.log",
        env=env,
    )
    await asyncio.to_thread(proc.start)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)
            dest = None
            for _ in range(100):  # until the first scrape landed
                call = stub.Process()
                await call.write(headers_msg())
                dest = destination(await call.read())
                await call.done_writing()
                assert await call.code() == grpc.StatusCode.OK
                if dest is not None:
                    break
                await asyncio.sleep(0.05)
            assert dest == fake_pods[0].pod
    finally:
        code = await asyncio.to_thread(proc.stop)
    assert code == 0, proc.log_tail()
