"""GPU time from a request's span on its pod and the pod's batch at each scrape."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import pytest

from ledger import gputime
from ledger.gputime import Batches
from llmgw import wire
from llmgw.link import RedisLink
from llmgw.podbatches import PodBatches, Scrape
from llmgw.resp import Resp
from tests.ratelimit.rl_redis import redis_port, start_redis

POD, OTHER = "10.0.0.1:8000", "10.0.0.2:8000"
NOW = 200.0


def batches(*scrapes: tuple[float, float], pod: str = POD) -> Batches:
    b = Batches(clock=lambda: NOW)
    b.observe(PodBatches(ts=NOW, pods={pod: [Scrape(at, n) for at, n in scrapes]}))
    return b


def test_a_request_shares_its_pods_time_with_its_batch() -> None:
    b = batches((100.0, 32.0))
    assert b.gpu_seconds(POD, 100.5, 102.5) == pytest.approx(2 / 32)  # 1/32 of 2 s
    # The batch as it changes: 4 for a second, then 1 (alone) for two.
    b = batches((100.0, 4.0), (101.0, 1.0))
    assert b.gpu_seconds(POD, 100.0, 103.0) == pytest.approx(1 / 4 + 2)
    assert b.gpu_seconds(POD, 100.5, 101.5) == pytest.approx(0.5 / 4 + 0.5)
    # A scrape that saw no request running yet: the request itself ran.
    assert batches((100.0, 0.0)).gpu_seconds(POD, 100.0, 101.0) == pytest.approx(1.0)


def test_before_the_first_count_the_first_holds_and_an_unknown_pod_is_none() -> None:
    b = batches((100.0, 2.0), (102.0, 8.0))
    assert b.gpu_seconds(POD, 99.0, 101.0) == pytest.approx(1.0)  # 2 s at 2
    assert b.gpu_seconds(POD, 101.0, 101.0) == 0.0
    assert b.gpu_seconds(OTHER, 99.0, 101.0) is None


def test_replicas_scrapes_interleave_and_a_repeated_count_adds_nothing() -> None:
    b = Batches(clock=lambda: 101.0)
    one = PodBatches(ts=100.0, pods={POD: [Scrape(99.0, 3.0), Scrape(99.5, 6.0)]})
    b.observe(one)
    b.observe(one)  # read twice
    # Another replica's entry: its scrapes overlap those known; the same count again is no step.
    other = [Scrape(99.4, 9.0), Scrape(100.1, 2.0), Scrape(100.2, 2.0)]
    b.observe(PodBatches(ts=100.2, pods={POD: other}))
    assert list(b._pods[POD].times) == [99.0, 99.5, 100.1]
    assert b.gpu_seconds(POD, 99.0, 100.5) == pytest.approx(0.5 / 3 + 0.6 / 6 + 0.4 / 2)


def test_history_is_bounded_a_pod_gone_is_forgotten_and_the_future_ignored() -> None:
    now = [0.0]
    b = Batches(history_s=10.0, max_pods=2, clock=lambda: now[0])
    for t in range(100):
        now[0] = float(t)
        b.observe(PodBatches(ts=float(t), pods={POD: [Scrape(float(t), float(t % 5 + 1))]}))
    assert len(b._pods[POD].times) <= 12  # the last 10 s, and the count in force before them
    assert b.gpu_seconds(POD, 95.0, 96.0) == pytest.approx(1 / 1)
    # A scrape a day ahead (a replica's clock) is ignored, and does not block the next ones.
    b.observe(PodBatches(ts=99.5, pods={POD: [Scrape(99.0 + 86_400, 50.0), Scrape(99.6, 7.0)]}))
    assert b.gpu_seconds(POD, 99.6, 100.6) == pytest.approx(1 / 7)
    now[0] = 200.0
    b.observe(PodBatches(ts=200.0, pods={OTHER: [Scrape(200.0, 1.0)], "x:1": [Scrape(200, 1)]}))
    assert b.gpu_seconds(POD, 95.0, 96.0) is None  # not scraped for longer than history
    assert b.gpu_seconds(OTHER, 200.0, 201.0) == pytest.approx(1.0)
    assert len(b._pods) <= 2  # max_pods


def test_a_steady_pod_is_kept_though_its_count_never_changes() -> None:
    now = [0.0]
    b = Batches(history_s=10.0, clock=lambda: now[0])
    for t in range(100):
        now[0] = float(t)
        b.observe(PodBatches(ts=float(t), pods={POD: [Scrape(float(t), 4.0)]}))
    assert len(b._pods[POD].times) == 1
    assert b.gpu_seconds(POD, 98.0, 99.0) == pytest.approx(0.25)


def test_the_contract_refuses_what_no_router_sends() -> None:
    for pods in (
        {POD: [[1.0, 1.0]] * 65},  # more scrapes than an entry holds
        {POD: [[1.0, -1.0]]},
        {POD: [[1.0, float("nan")]]},
    ):
        with pytest.raises(ValueError):
            PodBatches.model_validate_json(json.dumps({"ts": 1.0, "pods": pods}))


async def test_follow_reads_every_replicas_entries_from_the_stream(tmp_path: Path) -> None:
    redis = start_redis(tmp_path)
    port = redis_port(redis)
    client = await Resp.connect("127.0.0.1", port, 2.0)
    b = Batches(clock=lambda: 200.0)
    try:
        # Two replicas' entries before the ledger reads, and one that breaks the contract.
        for payload in (
            PodBatches(ts=100.0, pods={POD: [Scrape(100.0, 4.0)]}).model_dump_json(),
            "not json",
            PodBatches(ts=100.1, pods={OTHER: [Scrape(100.0, 2.0)]}).model_dump_json(),
        ):
            await client.call("XADD", wire.POD_BATCHES_KEY, "*", "b", payload)
        task = asyncio.create_task(gputime.follow(RedisLink("127.0.0.1", port, 1.0), b, 0.05))
        for _ in range(100):
            if b.gpu_seconds(OTHER, 100.0, 101.0) is not None:
                break
            await asyncio.sleep(0.05)
        assert b.gpu_seconds(POD, 100.0, 101.0) == pytest.approx(0.25)
        assert b.gpu_seconds(OTHER, 100.0, 101.0) == pytest.approx(0.5)
        # What is added later is read from where it left off.
        later = PodBatches(ts=101.0, pods={POD: [Scrape(101.0, 1.0)]}).model_dump_json()
        await client.call("XADD", wire.POD_BATCHES_KEY, "*", "b", later)
        for _ in range(100):
            if b.gpu_seconds(POD, 101.0, 102.0) == pytest.approx(1.0):
                break
            await asyncio.sleep(0.05)
        assert b.gpu_seconds(POD, 100.0, 102.0) == pytest.approx(0.25 + 1.0)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await client.close()
        redis.stop()
