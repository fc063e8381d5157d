"""Settlement (ledger/settle.lua) against the reservations admission makes (ratelimit/admit.lua),
on a real redis-server with an explicit clock."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from rl_redis import redis_port, start_redis

from ledger.recorder import Recorder, RedisLink
from ledger.settlement import Charge, Settled, settle
from llmgw.outcome import Outcome
from llmgw.procs import Process
from llmgw.resp import Resp
from llmgw.wire import tenant_prefix
from ratelimit.redis_store import RedisStore
from ratelimit.types import Check, Unit
from ratelimit.windows import SLIDING, fixed

T0 = 1_800_000_000_000  # ms, a multiple of every bucket size
PREFIX = tenant_prefix("acme")
DONE_TTL = 60_000


def tokens(limit: int, cost: int) -> list[Check]:
    return [Check("tokens:minute", SLIDING[Unit.MINUTE], limit, cost, True)]


async def used(store: RedisStore, now_ms: int, checks: list[Check] | None = None) -> list[int]:
    """Tokens inside each check's window at `now_ms` (a zero-cost admission reads them)."""
    probe = [Check(c.name, c.window, c.limit, 0, False) for c in checks or tokens(10**9, 0)]
    outcome = await store.admit(PREFIX, probe, now_ms)
    return [sum(c) for c in outcome.counts]


async def admit(store: RedisStore, rid: str, cost: int, now_ms: int, **kw: object) -> None:
    checks = kw.pop("checks", None) or tokens(10**9, cost)
    outcome = await store.admit(PREFIX, checks, now_ms, reservation=rid, ttl_ms=600_000)  # type: ignore[arg-type]
    assert outcome.admitted


async def one(resp: Resp, rid: str, actual: int, now_ms: int) -> Settled:
    (result,) = await settle(resp, [Charge("acme", rid, actual)], now_ms, DONE_TTL)
    return result


async def test_refund_to_the_reserved_bucket_and_excess_to_the_current(resp: Resp) -> None:
    store = RedisStore(resp)
    await admit(store, "a", 600, T0)
    assert await one(resp, "a", 100, T0 + 25_000) == Settled(1, 600, 100)
    assert await used(store, T0 + 25_000) == [100]
    await admit(store, "b", 300, T0 + 30_000)
    assert await one(resp, "b", 350, T0 + 45_000) == Settled(1, 300, 350)
    # The first bucket (100) leaves the window at T0+60 s; "b" counts 300 at T0+30 s and its 50
    # extra at T0+45 s, where it was used.
    assert await used(store, T0 + 60_000) == [350]
    assert await used(store, T0 + 90_000) == [50]


async def test_a_stream_longer_than_the_window_counts_in_both(resp: Resp) -> None:
    store = RedisStore(resp)
    await admit(store, "long", 2_000, T0)
    # Ten minutes later it ends having used 1500: the reservation's bucket left the minute long
    # ago, so the stream counts in the window it ended in too.
    assert await one(resp, "long", 1_500, T0 + 600_000) == Settled(1, 2_000, 1_500)
    assert await used(store, T0 + 600_000) == [1_500]


async def test_a_batch_delivered_twice_charges_once(resp: Resp) -> None:
    store = RedisStore(resp)
    await admit(store, "r", 500, T0)
    batch = [Charge("acme", "r", 120), Charge("acme", "unreserved", 30)]
    first = await settle(resp, batch, T0 + 1_000, DONE_TTL)
    again = await settle(resp, batch, T0 + 2_000, DONE_TTL)
    assert [s.state for s in first] == [1, 0] and [s.state for s in again] == [2, 2]
    assert await used(store, T0 + 2_000) == [150]


async def test_usage_without_a_reservation_is_charged_to_the_tenants_windows(resp: Resp) -> None:
    store = RedisStore(resp)
    # Nothing known about the tenant yet: no windows to charge.
    assert await one(resp, "early", 40, T0) == Settled(0, 0, 0)
    await admit(store, "x", 10, T0 + 1_000)  # admission records the tenant's token windows
    assert await one(resp, "fail-open", 70, T0 + 2_000) == Settled(0, 0, 70)
    assert await used(store, T0 + 2_000) == [80]


async def test_an_unsettled_reservation_is_never_refunded(resp: Resp) -> None:
    store = RedisStore(resp)
    hour = [Check("tokens:hour", SLIDING[Unit.HOUR], 10**9, 900, True)]
    await admit(store, "lost", 900, T0, checks=hour)
    await store.admit(PREFIX, tokens(10**9, 0), T0 + 1_200_000)  # admissions much later
    assert await used(store, T0 + 1_200_000, hour) == [900]


async def test_every_reserved_window_is_settled_budget_included(resp: Resp) -> None:
    """The reservation carries its windows (the tenant's own limits, a day budget), so the ledger
    needs no copy of anyone's limits."""
    store = RedisStore(resp)
    checks = [
        Check("tokens:minute", SLIDING[Unit.MINUTE], 100, 60, True),
        Check("budget:day", fixed(Unit.DAY), 1_000, 60, True),
    ]
    await admit(store, "r", 60, T0, checks=checks)
    assert await one(resp, "r", 20, T0 + 5_000) == Settled(1, 60, 20)
    assert await used(store, T0 + 5_000, checks) == [20, 20]


async def test_concurrent_settlements_sum_to_actual_usage(resp: Resp) -> None:
    store = RedisStore(resp)
    rng = random.Random(9)
    actual = [rng.randrange(0, 2000) for _ in range(200)]
    for i in range(200):
        await admit(store, f"s{i}", rng.randrange(1, 2000), T0)
    charges = [Charge("acme", f"s{i}", n) for i, n in enumerate(actual)]
    await asyncio.gather(
        *(settle(resp, charges[i : i + 20], T0 + 3_000, DONE_TTL) for i in range(0, 200, 20))
    )
    assert await used(store, T0 + 3_000) == [sum(actual)]
    assert await resp.call("KEYS", f"{PREFIX}:res:*") == []


async def test_noscript_is_answered_by_loading_the_script(resp: Resp) -> None:
    store = RedisStore(resp)
    await admit(store, "n", 50, T0)
    assert await resp.call("SCRIPT", "FLUSH") == "OK"
    assert await one(resp, "n", 5, T0 + 1) == Settled(1, 50, 5)


class Collected:
    def __init__(self) -> None:
        self.records: list[Outcome] = []

    def submit(self, records: Sequence[Outcome]) -> None:
        self.records.extend(records)


def outcome(rid: str, tokens: int) -> Outcome:
    return Outcome(
        request_id=rid, ts=datetime.now(UTC), tenant="acme", status=200, outcome="ok",
        prompt_tokens=tokens, reserved_tokens=500,
    )  # fmt: skip


async def test_outcomes_wait_while_redis_is_down_and_settle_when_it_returns(
    tmp_path: Path, own_redis: Process
) -> None:
    port = redis_port(own_redis)
    client = await Resp.connect("127.0.0.1", port, 2.0)
    store = RedisStore(client)
    now = int(time.time() * 1000)
    for i in range(5):
        await admit(store, f"w{i}", 500, now)
    await client.close()
    own_redis.stop()
    sink = Collected()
    recorder = Recorder(
        RedisLink("127.0.0.1", port, 0.2), sink, batch_max=2, pending_max=100,
        done_ttl_s=60, timeout_s=0.5, retry_max_s=0.1,
    )  # fmt: skip
    recorder.start()
    recorder.add([outcome(f"w{i}", 10 * i) for i in range(5)])
    for _ in range(20):  # bounded: a few failed attempts
        await asyncio.sleep(0.05)
    assert recorder.pending == 5 and sink.records == []  # held, not lost, not refunded
    restarted = start_redis(tmp_path, port)
    try:
        # A fresh Redis (no AOF here) has no reservations: each outcome is then settled as
        # unreserved; what matters is that every one is settled and handed on exactly once.
        for _ in range(100):
            if len(sink.records) == 5:
                break
            await asyncio.sleep(0.05)
        assert sorted(r.request_id for r in sink.records) == [f"w{i}" for i in range(5)]
        assert recorder.pending == 0
    finally:
        await recorder.close(1.0)
        restarted.stop()
