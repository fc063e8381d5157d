"""The fleet load and its publisher, and the contract with the rate limiter that reads it."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
import redis.asyncio

from llmgw import wire
from llmgw.link import RedisLink
from ratelimit import fleet as ratelimit_fleet
from ratelimit.redis_store import RedisStore
from router import publisher
from router.collectors.scraper import Scraper
from router.fleet import Fleet, FleetSettings
from router.types import PodMetrics
from tests.router.conftest import Clock, FakePod, metrics_text


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
    load = publisher.fleet_load(fleet)  # b was never scraped: counts as load 1
    assert load.load == pytest.approx((0.5 + 1.0) / 2)
    assert (load.capacity_tpm, load.capacity_rpm) == (0, 0)  # nothing served: unknown


def test_each_scrapes_batch_is_taken_once_in_unix_time() -> None:
    """For the ledger's GPU time (ledger/gputime.py): every good scrape's running count since the
    last entry, at the scrape's own time; a failed scrape or a gone pod adds none."""
    clock = Clock()
    fleet = Fleet(FleetSettings(capacity=10), clock=clock)
    fleet.set_pods(["a:1", "b:1"])
    log = publisher.ScrapeLog(fleet)
    fleet.listeners.append(log.scraped)
    started = time.time()
    for i, running in enumerate((3.0, 5.0)):
        fleet.store(PodMetrics("a:1", clock.now - 0.5 + i * 0.1, ok=True, running=running))
    fleet.store(PodMetrics("b:1", clock.now, ok=False, running=9.0))
    entry = log.take()
    assert [s.running for s in entry.pods["a:1"]] == [3.0, 5.0] and "b:1" not in entry.pods
    first, second = (s.at for s in entry.pods["a:1"])
    assert started - 0.6 < first < second <= time.time() - 0.35  # when scraped, not taken
    assert log.take().pods == {}  # taken once
    fleet.store(PodMetrics("a:1", clock.now, ok=True, running=1.0))
    fleet.set_pods(["b:1"])
    assert log.take().pods == {}
    for i in range(100):  # a publisher that cannot write keeps a pod's latest only
        fleet.store(PodMetrics("b:1", clock.now, ok=True, running=float(i)))
    assert [s.running for s in log.take().pods["b:1"]] == [float(i) for i in range(36, 100)]


async def test_fleet_load_publishes_the_capacity_measured_from_scrapes(
    fake_pods: list[FakePod],
) -> None:
    a, b, _ = fake_pods
    clock = Clock()
    fleet = Fleet(FleetSettings(capacity=10, scrape_timeout=1.0, stale_after=60), clock=clock)
    fleet.set_pods([a.pod, b.pod])
    scraper = Scraper(fleet)
    async with aiohttp.ClientSession() as session:
        for second in range(6):  # a serves 400 tokens and 1 request a second, 5 of 10 running
            a.text = metrics_text(running=5) + served(400 * second, second)
            await scraper.scrape_once(session)
            clock.now += 1
        clock.now -= 1
        assert publisher.fleet_load(fleet).capacity_tpm == 400 / 0.5 * 60
        assert publisher.fleet_load(fleet).capacity_rpm == 1 / 0.5 * 60
        b.status = 500  # a pod the router would not pick adds nothing
        a.status = 500
        await scraper.scrape_once(session)
    assert (publisher.fleet_load(fleet).capacity_tpm, publisher.fleet_load(fleet).capacity_rpm) == (
        0,
        0,
    )


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
    task = asyncio.create_task(publisher.run(fleet, link))
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
    writes to Redis, ratelimit's store reads and parses to the load, capacity and contexts
    measured, and extauthz's view of the contexts (the limiter's `FleetView`) gives them."""
    a, _, _ = fake_pods
    a.contexts = {"m": 1200}
    clock = Clock()
    settings = FleetSettings(capacity=10, scrape_timeout=1.0, stale_after=60, publish_interval=0.05)
    fleet = Fleet(settings, clock=clock)
    fleet.set_pods([a.pod])
    scraper = Scraper(fleet)
    async with aiohttp.ClientSession() as session:
        for second in range(6):  # 400 tokens and 1 request a second, 5 of 10 running
            a.text = metrics_text(running=5) + served(400 * second, second)
            await scraper.scrape_once(session)
            clock.now += 1
    client = redis.asyncio.Redis(port=redis_port)
    await client.delete(wire.FLEET_LOAD_KEY)
    link = RedisLink("127.0.0.1", redis_port, 1.0)
    task = asyncio.create_task(publisher.run(fleet, link))
    try:
        await published(client)
        store = RedisStore(await link.get())
        read = ratelimit_fleet.parse(await store.get_fleet(wire.FLEET_LOAD_KEY))
        view = ratelimit_fleet.FleetView(lambda: store.get_fleet(wire.FLEET_LOAD_KEY), time.time)
        assert view.context("m") is None  # nothing read yet: the refresh starts
        for _ in range(100):
            await asyncio.sleep(0.01)
            if view.context("m") is not None:
                break
        assert (view.context("m"), view.context("other")) == (1200, None)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await link.close()
        await client.aclose()
    written = publisher.fleet_load(fleet)
    assert read.model_dump(exclude={"ts"}) == written.model_dump(exclude={"ts"})
    assert (read.load, read.capacity_tpm, read.capacity_rpm) == (0.5, 48_000, 120)
    assert read.contexts == {"m": 1200}
    assert abs(read.ts - time.time()) < 5


def test_the_fleet_load_of_another_version_reads() -> None:
    """A router of an older version writes no contexts (none known: the cap as before); one of
    a newer version may add fields, which are ignored."""
    old = ratelimit_fleet.parse(b'{"load": 0.25, "ts": 5.0}')
    assert (old.load, old.contexts) == (0.25, {})
    new = ratelimit_fleet.parse(b'{"load": 0.25, "ts": 5.0, "contexts": {"m": 8}, "later": [1]}')
    assert (new.load, new.contexts) == (0.25, {"m": 8})
