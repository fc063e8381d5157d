"""Settlement (llmgw/settle.lua) against the reservations admission makes (ratelimit/admit.lua),
on a real redis-server in real time: both scripts read Redis's TIME, so windows are small where
a test needs buckets to pass."""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from rl_redis import redis_port, start_redis

from ledger.recorder import Recorder
from llmgw import breaker, reservation, settlement
from llmgw.link import RedisLink
from llmgw.outcome import Outcome
from llmgw.resp import Resp
from llmgw.settlement import Charge, Settled, settle
from llmgw.wire import tenant_prefix
from ratelimit.redis_store import ADMIT, REPLAY, RedisStore
from ratelimit.types import Check, Unit, Window
from ratelimit.windows import SLIDING, fixed, used
from tools.procs import Process

PREFIX = tenant_prefix("acme")
DONE_TTL = 60_000
MINUTE = [Check("tokens:minute", SLIDING[Unit.MINUTE], 10**9, 0, True)]


def costing(cost: int, checks: Sequence[Check] = MINUTE) -> list[Check]:
    return [Check(c.name, c.window, c.limit, cost, True) for c in checks]


async def admit(
    store: RedisStore,
    rid: str,
    cost: int,
    checks: Sequence[Check] = MINUTE,
    tenant: str = "acme",
    ttl_ms: int = 600_000,
) -> int:
    """A reservation of `cost` in every check; Redis's time of the admission (ms)."""
    outcome = await store.admit(
        tenant_prefix(tenant), costing(cost, checks), 0, reservation=rid, ttl_ms=ttl_ms
    )
    assert outcome.admitted
    return outcome.now_ms


async def in_window(
    store: RedisStore, checks: Sequence[Check] = MINUTE, tenant: str = "acme"
) -> list[int]:
    """Each window's use now, by the rule (a zero-cost admission reads the buckets)."""
    probe = [Check(c.name, c.window, c.limit, 0) for c in checks]
    outcome = await store.admit(tenant_prefix(tenant), probe, 0)
    return [used(c.window, n, outcome.now_ms) for c, n in zip(probe, outcome.counts, strict=True)]


async def buckets(resp: Resp, name: str) -> dict[int, int]:
    """A window's bucket keys: index → count."""
    keys = await resp.call("KEYS", f"{PREFIX}:{name}:*")
    assert isinstance(keys, list)
    held: dict[int, int] = {}
    for key in keys:
        assert isinstance(key, bytes)
        value = await resp.call("GET", key)
        assert isinstance(value, bytes)
        held[int(key.rsplit(b":", 1)[1])] = int(value)
    return held


async def redis_ms(resp: Resp) -> int:
    reply = await resp.call("TIME")
    assert isinstance(reply, list)
    seconds, micros = (int(v) for v in reply if isinstance(v, bytes))
    return seconds * 1000 + micros // 1000


async def one(resp: Resp, rid: str, actual: int) -> Settled:
    (result,) = await settle(resp, [Charge("acme", rid, actual)], DONE_TTL)
    return result


def test_admission_and_settlement_spell_the_keys_only_in_their_shared_prelude() -> None:
    """A key admission wrote under one name and settlement read under another would leave every
    reservation unsettled (charged as reserved): every script takes them from one prelude, and
    the tests below run admission's reservations through settlement."""
    for source in (ADMIT[0], REPLAY[0], settlement.SOURCE):
        own = source.replace(reservation.PRELUDE, "").replace(breaker.PRELUDE, "")
        assert own != source
        assert not re.search(r"':(res|tspec|done)\b|\.\. ':' \.\.", own), own


async def test_refund_to_the_reserved_bucket_and_excess_to_the_current(resp: Resp) -> None:
    store = RedisStore(resp)
    window = [Check("tokens:w", Window(3_000, 500), 10**9, 0, True)]
    a = await admit(store, "a", 600, window) // 500
    await asyncio.sleep(0.55)  # a later bucket, the reserved one still inside the window
    assert await one(resp, "a", 100) == Settled(1, 600, 100)
    b = await admit(store, "b", 300, window) // 500
    await asyncio.sleep(0.55)
    assert await one(resp, "b", 350) == Settled(1, 300, 350)
    # The refund went into "a"'s bucket; "b"'s 50 extra into the bucket it was settled in.
    held = await buckets(resp, "tokens:w")
    assert a < b < max(held) and held == {a: 100, b: 300, max(held): 50}
    assert await in_window(store, window) == [450]


async def test_a_stream_outliving_its_window_counts_in_every_window_it_ran_in(
    resp: Resp,
) -> None:
    """Settled while its reserved bucket decays (window a) or after it left (window b): the
    reservation stays where it was charged, no refund, and the tokens used count in the
    current bucket as well."""
    store = RedisStore(resp)
    windows = [
        Check("tokens:a", Window(2_000, 500), 10**9, 0, True),
        Check("tokens:b", Window(1_000, 100), 10**9, 0, True),
    ]
    at = await admit(store, "long", 2_000, windows)
    decaying = at // 500 + 4  # the first bucket in which "a"'s reserved bucket is c − N
    await asyncio.sleep((decaying * 500 + 100 - await redis_ms(resp)) / 1000)
    assert await one(resp, "long", 1_500) == Settled(1, 2_000, 1_500)
    assert await buckets(resp, "tokens:a") == {at // 500: 2_000, decaying: 1_500}
    assert list((await buckets(resp, "tokens:b")).values()) == [1_500]  # the reserved expired
    use_a, use_b = await in_window(store, windows)
    assert 1_500 < use_a <= 3_500 and use_b == 1_500


async def test_the_buckets_settlement_creates_live_as_long_as_admissions(resp: Resp) -> None:
    """N + 2 buckets for a rolling window, N + 1 for a fixed one (as admit.lua)."""
    store = RedisStore(resp)
    windows = [
        Check("tokens:r", Window(1_000, 100), 10**9, 0, True),
        Check("budget:f", Window(300, 300, rolling=False), 10**9, 0, True),
    ]
    await admit(store, "x", 10, windows)
    # Later buckets of both, the fixed one's reserved bucket gone (it lives 600 ms; while it
    # lives, a budget's settlement stays in it): settlement makes the keys it adds to.
    await asyncio.sleep(0.65)
    before = await redis_ms(resp)
    assert await one(resp, "x", 40) == Settled(1, 10, 40)
    for name, life in (("tokens:r", 1_200), ("budget:f", 600)):
        current = max(await buckets(resp, name))
        ttl = await resp.call("PTTL", f"{PREFIX}:{name}:{current}")
        elapsed = await redis_ms(resp) - before
        assert isinstance(ttl, int) and life - elapsed <= ttl <= life, name


async def test_a_batch_delivered_twice_charges_once(resp: Resp) -> None:
    store = RedisStore(resp)
    await admit(store, "r", 500)
    batch = [Charge("acme", "r", 120), Charge("acme", "unreserved", 30)]
    first = await settle(resp, batch, DONE_TTL)
    again = await settle(resp, batch, DONE_TTL)
    assert [s.state for s in first] == [1, 0] and [s.state for s in again] == [2, 2]
    assert await in_window(store) == [150]


async def test_usage_without_a_reservation_is_charged_to_the_tenants_windows(resp: Resp) -> None:
    store = RedisStore(resp)
    # Nothing known about the tenant yet: no windows to charge.
    assert await one(resp, "early", 40) == Settled(0, 0, 0)
    await admit(store, "x", 10)  # admission records the tenant's token windows
    assert await one(resp, "fail-open", 70) == Settled(0, 0, 70)
    assert await in_window(store) == [80]


async def test_an_unsettled_reservation_is_never_refunded(resp: Resp) -> None:
    """Expired before its outcome arrived: what was reserved stays charged, and the late
    settlement charges what was used on top (the strict side)."""
    store = RedisStore(resp)
    await admit(store, "lost", 900, ttl_ms=50)
    await asyncio.sleep(0.1)
    assert await resp.call("EXISTS", f"{PREFIX}:res:lost") == 0
    assert await one(resp, "lost", 100) == Settled(0, 0, 100)
    assert await in_window(store) == [1_000]


async def test_every_reserved_window_is_settled_budget_included(resp: Resp) -> None:
    """The reservation carries its windows (the tenant's own limits, a day budget), so the ledger
    needs no copy of anyone's limits."""
    store = RedisStore(resp)
    checks = [
        Check("tokens:minute", SLIDING[Unit.MINUTE], 100, 0, True),
        Check("budget:day", fixed(Unit.DAY), 1_000, 0, True),
    ]
    await admit(store, "r", 60, checks)
    assert await one(resp, "r", 20) == Settled(1, 60, 20)
    assert await in_window(store, checks) == [20, 20]


async def test_pipelined_batches_of_many_tenants_sum_to_actual_usage(resp: Resp) -> None:
    store = RedisStore(resp)
    rng = random.Random(9)
    tenants = [f"t{i}" for i in range(10)]
    actual = [rng.randrange(0, 2000) for _ in range(200)]
    await asyncio.gather(
        *(admit(store, f"s{i}", rng.randrange(1, 2000), tenant=tenants[i % 10]) for i in range(200))
    )
    charges = [Charge(tenants[i % 10], f"s{i}", n) for i, n in enumerate(actual)]
    await asyncio.gather(*(settle(resp, charges[i : i + 20], DONE_TTL) for i in range(0, 200, 20)))
    for k, tenant in enumerate(tenants):
        assert await in_window(store, tenant=tenant) == [sum(actual[k::10])], tenant
    assert await resp.call("KEYS", "llmgw:rl:*:res:*") == []


async def test_noscript_is_answered_by_loading_the_script(resp: Resp) -> None:
    store = RedisStore(resp)
    await admit(store, "n", 50)
    assert await resp.call("SCRIPT", "FLUSH") == "OK"
    assert await one(resp, "n", 5) == Settled(1, 50, 5)


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


def started_recorder(port: int, sink: Collected, batch_max: int, timeout_s: float) -> Recorder:
    recorder = Recorder(
        RedisLink("127.0.0.1", port, 0.2), sink, batch_max=batch_max, pending_max=100,
        done_ttl_s=60, timeout_s=timeout_s, retry_max_s=0.1,
    )  # fmt: skip
    recorder.start()
    return recorder


async def handed_on(sink: Collected, n: int) -> None:
    """Until `n` records reached the sink (bounded: 5 s)."""
    for _ in range(100):
        if len(sink.records) >= n:
            return
        await asyncio.sleep(0.05)


async def test_outcomes_wait_while_redis_is_down_and_settle_when_it_returns(
    tmp_path: Path, own_redis: Process
) -> None:
    port = redis_port(own_redis)
    client = await Resp.connect("127.0.0.1", port, 2.0)
    store = RedisStore(client)
    for i in range(5):
        await admit(store, f"w{i}", 500)
    await client.close()
    own_redis.stop()
    sink = Collected()
    recorder = started_recorder(port, sink, batch_max=2, timeout_s=0.5)
    recorder.add([outcome(f"w{i}", 10 * i) for i in range(5)])
    for _ in range(20):  # bounded: a few failed attempts
        await asyncio.sleep(0.05)
    assert recorder.pending == 5 and sink.records == []  # held, not lost, not refunded
    restarted = start_redis(tmp_path, port)
    try:
        # A fresh Redis (no AOF here) has no reservations: each outcome is then settled as
        # unreserved; what matters is that every one is settled and handed on exactly once.
        await handed_on(sink, 5)
        assert sorted(r.request_id for r in sink.records) == [f"w{i}" for i in range(5)]
        assert recorder.pending == 0
    finally:
        await recorder.close(1.0)
        restarted.stop()


async def test_a_refusal_never_releases_a_reservation_made_under_its_request_id(
    resp: Resp, redis: int
) -> None:
    """A request the rate limiter refused reserved nothing: its outcome settles nothing, even
    when another request's reservation has its ID (Envoy mints the IDs; this holds whatever
    reaches the ledger), and it is recorded as charging nothing."""
    store = RedisStore(resp)
    await admit(store, "twin", 500)
    sink = Collected()
    recorder = started_recorder(redis, sink, batch_max=10, timeout_s=2.0)
    try:
        for flags in ("UAEX", "RL"):  # the limiter inside extauthz, or behind its filter
            refused = outcome("twin", 0).model_copy(
                update={
                    "status": 429, "outcome": "refused", "flags": flags, "pod": "",
                    "quota_checked": True, "prompt_tokens": 0,
                }
            )  # fmt: skip
            recorder.add([refused])
        await handed_on(sink, 2)
        assert [r.charged_tokens for r in sink.records] == [0, 0]
        assert await in_window(store) == [500]  # still reserved: nothing released
        recorder.add([outcome("twin", 120)])  # the admitted request's own end settles it
        await handed_on(sink, 3)
        assert sink.records[-1].charged_tokens == 120
        assert await in_window(store) == [120]
    finally:
        await recorder.close(1.0)
