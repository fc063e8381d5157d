"""Scraping and the fleet: parsing, failures, staleness, error replies, resolving, fleet load."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest
import redis.asyncio

from llmgw import wire
from llmgw.link import RedisLink
from llmgw.sim.pod import SimPod
from llmgw.sim.types import DEFAULT_MODEL, SimSettings
from ratelimit import fleet as ratelimit_fleet
from ratelimit.redis_store import RedisStore
from router import scrape
from router.fleet import DnsTarget, Fleet, FleetSettings
from router.scrape import parse_metrics
from router.types import PodMetrics
from tests.router.conftest import Clock, FakePod, metrics_text


def test_parse_v1_names_and_cache_config() -> None:
    p = parse_metrics(metrics_text(running=3, waiting=2, kv=0.25, blocks=777, itl=(1.5, 100)))
    assert (p.running, p.waiting, p.kv_usage) == (3.0, 2.0, 0.25)
    assert (p.block_size, p.num_gpu_blocks) == (16, 777)
    assert (p.itl_seconds, p.itl_count) == (1.5, 100.0)


def test_parse_older_gpu_cache_name_and_several_engines() -> None:
    text = (
        'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 3.0\n'
        'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.2\n'
        'vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.4\n'
        "vllm:num_requests_waiting 1\n"
        "vllm:num_requests_waiting_by_reason 9\n"
    )
    p = parse_metrics(text)
    assert (p.running, p.waiting) == (5.0, 1.0)
    assert p.kv_usage == pytest.approx(0.3)
    assert p.block_size is None


def test_parse_prefers_v1_kv_name_and_ignores_garbage() -> None:
    text = (
        "vllm:kv_cache_usage_perc 0.5\nvllm:gpu_cache_usage_perc 0.9\nvllm:num_requests_running x\n"
    )
    p = parse_metrics(text)
    assert p.kv_usage == 0.5 and p.running == 0.0


async def test_scrape_reads_metrics_and_models(fake_pods: list[FakePod]) -> None:
    a, b, c = fake_pods
    a.text = metrics_text(running=4, waiting=1, kv=0.5, blocks=2048)
    b.models = ["other"]
    fleet = Fleet(FleetSettings(scrape_timeout=1.0))
    fleet.set_pods([a.pod, b.pod, c.pod])
    async with aiohttp.ClientSession() as session:
        await fleet.scrape_once(session)
    snap = fleet.snapshots[a.pod]
    assert snap.ok and (snap.running, snap.waiting, snap.kv_usage) == (4, 1, 0.5)
    assert snap.kv_tokens == 2048 * 16 and snap.models == frozenset({"m"})
    assert fleet.snapshots[b.pod].models == frozenset({"other"})
    assert all(c.healthy and c.fresh for c in fleet.candidates())


async def test_the_scrapes_send_the_pods_key() -> None:
    """A pod run with vLLM's --api-key answers /v1/models only with it: without the key the
    router would know none of its models."""
    key = "9f2c41e8a7b3d6055f1e2a9c0b7d64e3"
    async with SimPod(SimSettings(port=0, api_key=key)) as pod:
        address = pod.url.removeprefix("http://")
        for given, models in ((None, frozenset()), (key, frozenset({DEFAULT_MODEL}))):
            fleet = Fleet(FleetSettings(scrape_timeout=1.0, pod_api_key=given))
            fleet.set_pods([address])
            async with fleet.scrape_session() as session:
                await fleet.scrape_once(session)
            assert fleet.snapshots[address].models == models, given


async def test_candidates_carry_each_pods_speed_from_its_inter_token_latency(
    fake_pods: list[FakePod],
) -> None:
    clock = Clock()
    fleet = Fleet(FleetSettings(scrape_timeout=1.0), clock=clock)
    fleet.set_pods([p.pod for p in fake_pods])
    fast, slow, idle = fake_pods
    async with aiohttp.ClientSession() as session:
        await fleet.scrape_once(session)
        fast.text = metrics_text(itl=(1.0, 100))  # 10 ms a token
        slow.text = metrics_text(itl=(2.0, 100))  # 20 ms: half as fast
        clock.now += 1
        await fleet.scrape_once(session)
    speeds = {c.pod: c.speed for c in fleet.candidates()}
    assert speeds == {fast.pod: 1.0, slow.pod: 0.5, idle.pod: 1.0}  # no tokens yet: full speed


async def test_failed_scrape_makes_pod_unpickable_until_it_recovers(
    fake_pods: list[FakePod],
) -> None:
    a, b, _ = fake_pods
    fleet = Fleet(FleetSettings(scrape_timeout=1.0))
    fleet.set_pods([a.pod, b.pod])
    a.status = 500
    async with aiohttp.ClientSession() as session:
        await fleet.scrape_once(session)
        healthy = {c.pod: c.healthy for c in fleet.candidates()}
        assert healthy == {a.pod: False, b.pod: True}
        a.status = 200
        await fleet.scrape_once(session)
    assert all(c.healthy for c in fleet.candidates())


async def test_unreachable_pod_is_unpickable() -> None:
    fleet = Fleet(FleetSettings(scrape_timeout=0.2))
    fleet.set_pods(["127.0.0.1:1"])
    async with aiohttp.ClientSession() as session:
        await fleet.scrape_once(session)
    assert not fleet.candidates()[0].healthy


def test_staleness_counts_as_fully_loaded() -> None:
    clock = Clock()
    fleet = Fleet(FleetSettings(stale_after=0.5, capacity=10), clock=clock)
    fleet.set_pods(["a:1"])
    fleet.snapshots["a:1"] = PodMetrics("a:1", clock.now, ok=True, running=1, kv_usage=0.1)
    fresh = fleet.candidates()[0]
    assert fresh.fresh and fresh.load == pytest.approx(0.1) and fresh.kv == 0.1
    clock.now += 0.6
    stale = fleet.candidates()[0]
    assert stale.healthy and not stale.fresh
    assert (stale.kv, stale.queue, stale.load) == (1.0, 10, 1.0)
    assert not fleet.snapshots["a:1"].fresh(0.5, clock.now)


def test_error_replies_take_a_pod_out_for_the_cooldown() -> None:
    clock = Clock()
    fleet = Fleet(FleetSettings(error_threshold=3, error_cooldown=2.0), clock=clock)
    fleet.set_pods(["a:1"])
    fleet.snapshots["a:1"] = PodMetrics("a:1", clock.now, ok=True)
    for status in (503, 502, 200, 500, 500):  # a success resets the streak
        fleet.report("a:1", status)
    assert fleet.candidates()[0].healthy
    fleet.report("a:1", 503)
    assert not fleet.candidates()[0].healthy
    clock.now += 2.1
    assert fleet.candidates()[0].healthy


def test_a_pod_failing_again_stays_out_longer_until_it_answers_well() -> None:
    clock = Clock()
    fleet = Fleet(FleetSettings(error_threshold=1, error_cooldown=1.0), clock=clock)
    fleet.set_pods(["a:1"])
    fleet.snapshots["a:1"] = PodMetrics("a:1", clock.now, ok=True)
    for cooldown in (1.0, 2.0, 4.0):
        fleet.report("a:1", 503)
        clock.now += cooldown - 0.1
        assert not fleet.candidates()[0].healthy
        clock.now += 0.2
        assert fleet.candidates()[0].healthy
    fleet.report("a:1", 200)
    fleet.report("a:1", 503)
    clock.now += 1.1
    assert fleet.candidates()[0].healthy  # back to the base cooldown


def test_late_failures_of_a_pod_already_out_do_not_lengthen_its_penalty() -> None:
    """Outcomes arrive batched, after the fact: the picks that were in flight when the pod died
    all fail, but they are one incident, not many."""
    clock = Clock()
    fleet = Fleet(FleetSettings(error_threshold=1, error_cooldown=1.0), clock=clock)
    fleet.set_pods(["a:1"])
    fleet.snapshots["a:1"] = PodMetrics("a:1", clock.now, ok=True)
    for _ in range(40):  # forty picks in flight when it died
        fleet.report("a:1", 503)
    clock.now += 1.1
    assert fleet.candidates()[0].healthy  # one base cooldown, not 2**40 of them


def test_in_flight_counts_follow_acquire_and_release() -> None:
    fleet = Fleet(FleetSettings())
    fleet.set_pods(["a:1"])
    fleet.acquire("a:1")
    fleet.acquire("a:1")
    fleet.release("a:1")
    fleet.release("a:1")
    fleet.release("a:1")  # never below zero
    fleet.acquire("gone:1")  # unknown pods are ignored
    assert fleet.in_flight == {"a:1": 0}


async def test_resolve_static_and_dns_targets() -> None:
    fleet = Fleet(
        FleetSettings(pods=["127.0.0.1:8001"], dns=DnsTarget(name="localhost", port=8002))
    )
    found = await fleet.resolve()
    assert "127.0.0.1:8001" in found and "127.0.0.1:8002" in found
    fleet.set_pods(found)
    fleet.set_pods(["127.0.0.1:8001"])
    assert list(fleet.snapshots) == ["127.0.0.1:8001"]


def test_fleet_load() -> None:
    clock = Clock()
    fleet = Fleet(FleetSettings(capacity=10), clock=clock)
    fleet.set_pods(["a:1", "b:1"])
    fleet.snapshots["a:1"] = PodMetrics(
        "a:1",
        clock.now,
        ok=True,
        running=4,
        waiting=1,
        kv_usage=0.2,
        block_size=16,
        num_gpu_blocks=100,
    )
    load = fleet.load()  # b was never scraped: counts as load 1
    assert load.load == pytest.approx((0.5 + 1.0) / 2)
    assert (load.capacity_tpm, load.capacity_rpm) == (0, 0)  # nothing served: unknown


async def test_fleet_load_publishes_the_capacity_measured_from_scrapes(
    fake_pods: list[FakePod],
) -> None:
    a, b, _ = fake_pods
    clock = Clock()
    fleet = Fleet(FleetSettings(capacity=10, scrape_timeout=1.0, stale_after=60), clock=clock)
    fleet.set_pods([a.pod, b.pod])
    async with aiohttp.ClientSession() as session:
        for second in range(6):  # a serves 400 tokens and 1 request a second, 5 of 10 running
            a.text = metrics_text(running=5) + served(400 * second, second)
            await fleet.scrape_once(session)
            clock.now += 1
        clock.now -= 1
        assert fleet.load().capacity_tpm == 400 / 0.5 * 60
        assert fleet.load().capacity_rpm == 1 / 0.5 * 60
        b.status = 500  # a pod the router would not pick adds nothing
        a.status = 500
        await fleet.scrape_once(session)
    assert (fleet.load().capacity_tpm, fleet.load().capacity_rpm) == (0, 0)


def served(tokens: int, requests: int) -> str:
    return (
        f'vllm:prompt_tokens_total{{engine="0",model_name="m"}} {tokens / 2}\n'
        f'vllm:generation_tokens_total{{engine="0",model_name="m"}} {tokens / 2}\n'
        f'vllm:request_success_total{{engine="0",finished_reason="stop"}} {requests}\n'
    )


async def test_publisher_writes_the_fleet_load_key(redis_port: int) -> None:
    fleet = Fleet(FleetSettings(publish_interval=0.05, publish_ttl=5))
    fleet.set_pods(["a:1"])
    client = redis.asyncio.Redis(port=redis_port)
    await client.delete(wire.FLEET_LOAD_KEY)
    link = RedisLink("127.0.0.1", redis_port, 1.0)
    task = asyncio.create_task(fleet.run_publisher(link))
    try:
        load = ratelimit_fleet.parse(await published(client))
        assert load.load == 1.0 and load.ts > 0
        assert 0 < await client.pttl(wire.FLEET_LOAD_KEY) <= 5000
        # Redis drops the publisher's connection (a restart, a failover): the next round
        # connects again.
        await client.client_kill_filter(_type="normal", skipme=True)
        await client.delete(wire.FLEET_LOAD_KEY)
        assert ratelimit_fleet.parse(await published(client)).ts > 0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await link.close()
        await client.aclose()


async def published(client: redis.asyncio.Redis) -> bytes:
    """The fleet key, once the publisher has written it (bounded wait)."""
    for _ in range(100):
        raw = await client.get(wire.FLEET_LOAD_KEY)
        if raw is not None:
            assert isinstance(raw, bytes)
            return raw
        await asyncio.sleep(0.02)
    raise AssertionError("the fleet key was never published")


async def test_the_rate_limiter_reads_the_fleet_load_the_router_publishes(
    redis_port: int, fake_pods: list[FakePod]
) -> None:
    """The fleet-load contract (llmgw/fleetload.py) end to end: what the router's publisher
    writes to Redis, ratelimit's store reads and parses to the load and capacity measured."""
    a, _, _ = fake_pods
    clock = Clock()
    settings = FleetSettings(capacity=10, scrape_timeout=1.0, stale_after=60, publish_interval=0.05)
    fleet = Fleet(settings, clock=clock)
    fleet.set_pods([a.pod])
    async with aiohttp.ClientSession() as session:
        for second in range(6):  # 400 tokens and 1 request a second, 5 of 10 running
            a.text = metrics_text(running=5) + served(400 * second, second)
            await fleet.scrape_once(session)
            clock.now += 1
    client = redis.asyncio.Redis(port=redis_port)
    await client.delete(wire.FLEET_LOAD_KEY)
    link = RedisLink("127.0.0.1", redis_port, 1.0)
    task = asyncio.create_task(fleet.run_publisher(link))
    try:
        await published(client)
        read = ratelimit_fleet.parse(
            await RedisStore(await link.get()).get_fleet(wire.FLEET_LOAD_KEY)
        )
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await link.close()
        await client.aclose()
    written = fleet.load()
    assert read.model_dump(exclude={"ts"}) == written.model_dump(exclude={"ts"})
    assert (read.load, read.capacity_tpm, read.capacity_rpm) == (0.5, 48_000, 120)
    assert abs(read.ts - time.time()) < 5


def test_after_a_cooldown_a_pod_gets_one_probe_until_it_answers() -> None:
    clock = Clock()
    fleet = Fleet(FleetSettings(error_threshold=3, error_cooldown=1.0), clock=clock)
    fleet.set_pods(["a:1"])
    fleet.snapshots["a:1"] = PodMetrics("a:1", clock.now, ok=True)
    for _ in range(3):
        fleet.report("a:1", 503)
    clock.now += 1.1  # the cooldown is over: on probation
    assert fleet.pickable("a:1", clock.now)
    fleet.acquire("a:1", "probe")
    assert not fleet.pickable("a:1", clock.now)  # its answer is on its way
    fleet.finish("probe")
    fleet.report("a:1", 503)  # one failed probe is enough to take it out again
    assert not fleet.pickable("a:1", clock.now)
    clock.now += 2.1  # twice the cooldown
    fleet.acquire("a:1", "lost")  # a probe whose outcome never comes …
    clock.now += 1.1
    assert fleet.pickable("a:1", clock.now)  # … lets another one through after a cooldown
    fleet.report("a:1", 200)
    fleet.finish("lost")
    fleet.acquire("a:1", "x")
    assert fleet.pickable("a:1", clock.now)  # answered well: no probation


async def test_one_pods_unreadable_page_stops_no_scrape(
    fake_pods: list[FakePod], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stray non-UTF-8 byte on a page is read past; a scrape that fails in a way no page
    should cause counts as that pod's failed scrape, and the others' scrapes go on (one pod's
    page once ended the scrape loop, and every pod went stale for good)."""
    a, b, c = fake_pods
    a.tail = b"# \xff\xfe\n"
    fleet = Fleet(FleetSettings(pods=[p.pod for p in fake_pods], scrape_timeout=1.0))
    fleet.set_pods(await fleet.resolve())
    real = scrape.scrape_metrics

    async def broken(session: Any, pod: str, *args: Any) -> Any:
        if pod == b.pod:
            raise RuntimeError("a bug")
        return await real(session, pod, *args)

    monkeypatch.setattr("router.fleet.scrape_metrics", broken)
    async with aiohttp.ClientSession() as session:
        await fleet.scrape_once(session)
    assert {p: s.ok for p, s in fleet.snapshots.items()} == {a.pod: True, b.pod: False, c.pod: True}
