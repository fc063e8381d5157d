"""GPU time from a request's span on its pod and the pod's published batch."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from ledger import gputime
from ledger.gputime import Batches
from llmgw import wire
from llmgw.fleetload import FleetLoad
from llmgw.link import RedisLink
from llmgw.resp import Resp
from tests.ratelimit.rl_redis import redis_port, start_redis

POD, OTHER = "10.0.0.1:8000", "10.0.0.2:8000"


def batches(*series: tuple[float, float]) -> Batches:
    b = Batches()
    for ts, running in series:
        b.observe(FleetLoad(load=0.5, ts=ts, batches={POD: [(ts, running)]}))
    return b


def test_a_request_shares_its_pods_time_with_its_batch() -> None:
    b = batches((100.0, 32.0))
    assert b.gpu_seconds(POD, 100.5, 102.5) == pytest.approx(2 / 32)  # 1/32 of 2 s
    # The batch as it changes: 4 for a second, then 1 (alone) for two.
    b = batches((100.0, 4.0), (101.0, 1.0))
    assert b.gpu_seconds(POD, 100.0, 103.0) == pytest.approx(1 / 4 + 2)
    # A scrape that saw no request running yet: the request itself ran.
    assert batches((100.0, 0.0)).gpu_seconds(POD, 100.0, 101.0) == pytest.approx(1.0)


def test_before_the_first_count_the_first_holds_and_an_unknown_pod_is_none() -> None:
    b = batches((100.0, 2.0), (102.0, 8.0))
    assert b.gpu_seconds(POD, 99.0, 101.0) == pytest.approx(1.0)  # 2 s at 2
    assert b.gpu_seconds(POD, 101.0, 101.0) == 0.0
    assert b.gpu_seconds(OTHER, 99.0, 101.0) is None


def test_history_is_bounded_and_a_pod_gone_is_forgotten() -> None:
    b = Batches(history_s=10.0, max_pods=2)
    for t in range(100):
        b.observe(FleetLoad(load=0.5, ts=float(t), batches={POD: [(float(t), float(t % 5 + 1))]}))
    assert len(b._times[POD]) <= 12  # the last 10 s, and the count in force before them
    # Still answered from the count that held at the cutoff.
    assert b.gpu_seconds(POD, 95.0, 96.0) == pytest.approx(1 / 1)
    b.observe(
        FleetLoad(
            load=0.5, ts=200.0, batches={OTHER: [(200.0, 1.0)], "10.0.0.3:8000": [(200.0, 1.0)]}
        )
    )
    assert b.gpu_seconds(POD, 95.0, 96.0) is None  # not published for longer than history
    assert b.gpu_seconds(OTHER, 200.0, 201.0) == pytest.approx(1.0)
    assert len(b._times) <= 2  # max_pods


def test_a_publication_read_twice_counts_once_and_scrapes_arrive_in_order() -> None:
    b = Batches()
    load = FleetLoad(load=0.5, ts=100.0, batches={POD: [(99.0, 3.0), (99.5, 6.0)]})
    b.observe(load)
    b.observe(load)
    # Another replica's publication: its scrapes overlap those already known.
    b.observe(FleetLoad(load=0.5, ts=100.2, batches={POD: [(99.4, 9.0), (100.1, 2.0)]}))
    assert b._times[POD] == [99.0, 99.5, 100.1]
    assert b.gpu_seconds(POD, 99.0, 100.5) == pytest.approx(0.5 / 3 + 0.6 / 6 + 0.4 / 2)


async def test_follow_reads_the_routers_fleet_load_from_redis(tmp_path: Path) -> None:
    redis = start_redis(tmp_path)
    port = redis_port(redis)
    client = await Resp.connect("127.0.0.1", port, 2.0)
    b = Batches()
    task = asyncio.create_task(gputime.follow(RedisLink("127.0.0.1", port, 1.0), b, 0.05))
    try:
        await client.call("SET", wire.FLEET_LOAD_KEY, b"not json")  # skipped, not fatal
        await asyncio.sleep(0.2)
        load = FleetLoad(load=0.5, ts=100.0, batches={POD: [(100.0, 4.0)]})
        await client.call("SET", wire.FLEET_LOAD_KEY, load.model_dump_json())
        for _ in range(100):
            if b.gpu_seconds(POD, 100.0, 101.0) is not None:
                break
            await asyncio.sleep(0.05)
        assert b.gpu_seconds(POD, 100.0, 101.0) == pytest.approx(0.25)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await client.close()
        redis.stop()
