"""The gRPC service, called with RateLimitRequest messages filled exactly as Envoy fills them."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from google.protobuf import wrappers_pb2
from opentelemetry import trace

from llmgw.tiers import PerUnit, TierSpec, TierTable
from ratelimit.failover import Failover
from ratelimit.fleet import IDLE_UNKNOWN
from ratelimit.limiter import Limiter
from ratelimit.limits import Limits
from ratelimit.service import RateLimitService
from tools.procs import Process, free_port, grpc_serving

Code = rls_pb2.RateLimitResponse.Code
Stub = rls_pb2_grpc.RateLimitServiceStub
CONFIG = TierTable(
    tiers={"free": TierSpec(requests=PerUnit(minute=100), tokens=PerUnit(minute=10_000))}
)


def descriptor(
    *entries: tuple[str, str], hits: int | None = None
) -> ratelimit_pb2.RateLimitDescriptor:
    d = ratelimit_pb2.RateLimitDescriptor(
        entries=[ratelimit_pb2.RateLimitDescriptor.Entry(key=k, value=v) for k, v in entries]
    )
    if hits is not None:
        d.hits_addend.CopyFrom(wrappers_pb2.UInt64Value(value=hits))
    return d


def request_time(rid: str, estimate: int, tenant: str = "acme") -> rls_pb2.RateLimitRequest:
    return rls_pb2.RateLimitRequest(
        domain="llmgw",
        descriptors=[
            descriptor(
                ("kind", "requests"), ("tenant", tenant), ("tier", "free"), ("session", "sess_x")
            ),
            descriptor(
                ("kind", "tokens"),
                ("tenant", tenant),
                ("tier", "free"),
                ("request_id", rid),
                ("token_estimate", str(estimate)),
            ),
        ],
    )


async def serve_limiter(limiter: Limiter) -> tuple[grpc.aio.Server, int]:
    """The service over real gRPC on a free port: (server, port)."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    rls_pb2_grpc.add_RateLimitServiceServicer_to_server(
        RateLimitService(limiter, trace.get_tracer("test")), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


@pytest.fixture
async def stubs(
    redis: int, make_failover: Callable[..., Awaitable[Failover]]
) -> AsyncIterator[list[Stub]]:
    """Four in-process services (replicas) sharing one Redis, each behind its own channel."""
    servers, channels = [], []
    for _ in range(4):
        store = await make_failover(redis)
        limiter = Limiter(Limits(CONFIG).policy, store, lambda: IDLE_UNKNOWN, time.time)
        server, port = await serve_limiter(limiter)
        servers.append(server)
        channels.append(grpc.aio.insecure_channel(f"127.0.0.1:{port}"))
    yield [Stub(c) for c in channels]
    for channel in channels:
        await channel.close()
    for server in servers:
        await server.stop(None)


async def test_exact_through_four_grpc_replicas(stubs: list[Stub]) -> None:
    replies = await asyncio.gather(
        *(stubs[i % 4].ShouldRateLimit(request_time(f"r{i}", 10)) for i in range(400))
    )
    assert sum(r.overall_code == Code.OK for r in replies) == 100


async def test_ok_response_statuses_and_headers(stubs: list[Stub]) -> None:
    reply = await stubs[0].ShouldRateLimit(request_time("a", 400))
    assert reply.overall_code == Code.OK and not reply.raw_body
    requests, tokens = reply.statuses
    assert requests.code == Code.OK and requests.limit_remaining == 99
    assert requests.current_limit.requests_per_unit == 100
    assert requests.current_limit.unit == rls_pb2.RateLimitResponse.RateLimit.MINUTE
    assert tokens.limit_remaining == 9_600
    # Until the bucket has decayed away: the window and one bucket (ratelimit/windows.py).
    assert 60 <= tokens.duration_until_reset.seconds <= 70
    headers = {h.key: h.value for h in reply.response_headers_to_add}
    assert headers["x-ratelimit-limit-tokens"] == "10000"
    assert headers["x-ratelimit-remaining-tokens"] == "9600"
    assert headers["x-ratelimit-remaining-requests"] == "99"
    assert headers["x-ratelimit-reset-requests"].endswith("s")


async def test_token_refusal_is_an_openai_429(stubs: list[Stub]) -> None:
    assert (await stubs[0].ShouldRateLimit(request_time("a", 9_000))).overall_code == Code.OK
    reply = await stubs[1].ShouldRateLimit(request_time("b", 2_000))
    assert reply.overall_code == Code.OVER_LIMIT
    assert [s.code for s in reply.statuses] == [Code.OK, Code.OVER_LIMIT]
    headers = {h.key: h.value for h in reply.response_headers_to_add}
    assert headers["content-type"] == "application/json"
    assert int(headers["retry-after"]) >= 1 and int(headers["retry-after-ms"]) >= 1000
    error = json.loads(reply.raw_body)["error"]
    assert (error["type"], error["code"]) == ("tokens", "rate_limit_exceeded")
    assert "Limit 10000, Used 9000, Requested 2000" in error["message"]


async def test_other_domains_and_unknown_descriptors_pass(stubs: list[Stub]) -> None:
    other = rls_pb2.RateLimitRequest(
        domain="else", descriptors=[descriptor(("kind", "requests"), ("tenant", "acme"))]
    )
    reply = await stubs[0].ShouldRateLimit(other)
    assert reply.overall_code == Code.OK and [s.code for s in reply.statuses] == [Code.OK]
    odd = rls_pb2.RateLimitRequest(domain="llmgw", descriptors=[descriptor(("x", "y"))])
    assert (await stubs[0].ShouldRateLimit(odd)).overall_code == Code.OK


def test_python_m_ratelimit_serves_and_stops_on_sigterm(tmp_path: Path, redis: int) -> None:
    port = free_port()
    env_argv = [sys.executable, "-m", "ratelimit"]
    import os

    env = dict(os.environ)
    env |= {"LLMGW_RATELIMIT__SERVE__PORT": str(port), "LLMGW_RATELIMIT__REDIS__PORT": str(redis)}
    proc = Process(
        "ratelimit", env_argv, grpc_serving(f"127.0.0.1:{port}"), tmp_path / "rl.log", env=env
    ).start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = Stub(channel).ShouldRateLimit(request_time("a", 10), timeout=5)
            assert reply.overall_code == Code.OK
        assert proc.popen is not None
        proc.popen.send_signal(signal.SIGTERM)
        assert proc.popen.wait(15) == 0
    finally:
        proc.stop()


async def test_limits_beyond_32_bits_are_answered_not_failed_open(
    redis: int, make_failover: Callable[..., Awaitable[Failover]]
) -> None:
    """The RLS response's limit fields are 32-bit: a bigger limit (valid config) once raised on
    every request, and Envoy let everything through unchecked."""
    config = TierTable(tiers={"free": TierSpec(tokens=PerUnit(minute=10**10))})
    store = await make_failover(redis)
    limiter = Limiter(Limits(config).policy, store, lambda: IDLE_UNKNOWN, time.time)
    server, port = await serve_limiter(limiter)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            response = await Stub(channel).ShouldRateLimit(request_time("big", 400))
    finally:
        await server.stop(None)
    assert response.overall_code == Code.OK
    _, tokens = response.statuses
    assert tokens.current_limit.requests_per_unit == 2**32 - 1  # the field's largest value
    headers = {h.key: h.value for h in response.response_headers_to_add}
    assert headers["x-ratelimit-limit-tokens"] == str(10**10)  # the headers carry it whole
