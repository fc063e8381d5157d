"""The tenant breaker's Lua, against a real redis-server: admit.lua (enforcement) and the
ledger's feed (ledger/breaker.lua) checked step by step against the pure model
(tests/breaker_model.py) at Redis's own time, with short cool-downs from a custom tier; and two
rate-limit replicas sharing one breaker."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from ledger import breaker as feed
from ledger.breaker import Breakers
from llmgw.breaker import BreakerSpec
from llmgw.outcome import Outcome
from llmgw.resp import Resp
from llmgw.tiers import PerUnit, TierSpec, TierTable
from llmgw.wire import breaker_key, tenant_prefix
from ratelimit.failover import Failover
from ratelimit.fleet import IDLE_UNKNOWN
from ratelimit.limiter import Limiter
from ratelimit.limits import Limits
from ratelimit.redis_store import RedisStore
from ratelimit.response import circuit_open
from ratelimit.types import MAX_COUNT, Admission, Check, Unit, Verdict
from ratelimit.windows import SLIDING
from tests.breaker_model import Model

MakeFailover = Callable[..., Awaitable[Failover]]
FAST = BreakerSpec(
    threshold=2.0,
    mistakes_threshold=1.0,
    cooldown_s=0.12,
    cooldown_max_s=0.5,
    step_s=0.08,
    cooldown_growth=2.0,
)
OPEN_CHECK = Check("requests:second", SLIDING[Unit.SECOND], MAX_COUNT, 1)


async def fed(
    resp: Resp, tenant: str, spec: BreakerSpec, weights: list[tuple[float, str, str]]
) -> Any:
    args = [a for w, score, c in weights for a in (repr(w), score, c)]
    return await resp.call("EVALSHA", feed.SHA, 1, breaker_key(tenant), *spec.feed_args(), *args)


async def test_the_scripts_follow_the_model_at_redis_time(resp: Resp) -> None:
    """Random admissions and outcomes for 4 s of Redis time: every answer of both scripts is the
    model's at the time Redis decided at."""
    await resp.call("SCRIPT", "LOAD", feed.SOURCE)
    store = RedisStore(resp)
    model = Model(FAST)
    dice = random.Random(7)
    seen = {"refused_open": 0, "refused_half": 0, "trip": 0, "reopen": 0, "recover": 0}
    start = time.monotonic()
    while (elapsed := time.monotonic() - start) < 4.0:
        # Storms of 0.5 s, then 0.7 s of clean traffic (long enough to recover in).
        storm = elapsed % 1.2 < 0.5
        if dice.random() < 0.75:
            got = await store.admit(tenant_prefix("m"), [OPEN_CHECK], 0, breaker=breaker_key("m"))
            phase = model.phase(got.now_ms)[0]
            assert got.circuit_ms == model.admit(got.now_ms), phase
            if got.circuit_ms is not None:
                seen["refused_open" if phase == "open" else "refused_half"] += 1
            assert got.admitted == (got.circuit_ms is None)
        else:
            weights = [
                (dice.choice([0.0, 0.3, 0.7, 1.0, 1.2]) if storm else 0.0, *kind)
                for kind in dice.choices([("s", "500"), ("m", "429")], k=dice.randint(1, 3))
            ]
            now, *events = await fed(resp, "m", FAST, weights)
            decoded = [e.decode() for e in events]
            assert decoded == model.feed(int(now), weights)
            for e in decoded:
                kind = e.split()[0]
                seen["reopen" if kind == "trip" and e.split()[4] == "1" else kind] += 1
        await asyncio.sleep(dice.uniform(0, 0.012))
    assert all(n > 0 for n in seen.values()), seen  # every path was taken


async def test_half_open_admits_its_share_across_two_replicas(
    redis: int, make_failover: MakeFailover
) -> None:
    """Two rate-limit replicas share one breaker: both refuse while it is open, and in half-open
    they admit 1 in 10 together, 3 in 10 next, then all."""
    spec = BreakerSpec(threshold=2.0, cooldown_s=0.4, cooldown_max_s=1.0, step_s=1.5)
    table = TierTable(tiers={"fast": TierSpec(requests=PerUnit(second=10**6), breaker=spec)})
    limiters = [
        Limiter(Limits(table).policy, await make_failover(redis), lambda: IDLE_UNKNOWN, time.time)
        for _ in range(2)
    ]
    resp = await Resp.connect("127.0.0.1", redis, 2.0)
    breakers = Breakers(lambda: table, None, None)
    try:
        (trip,) = await breakers.feed(resp, [outcome("shared", 500), outcome("shared", 500)])
        assert (trip.kind, trip.cause, trip.cooldown_ms) == ("trip", "500", 400)

        async def admit(i: int) -> Verdict:
            return await limiters[i % 2].admit(Admission("shared", "fast"))

        refused = [await admit(i) for i in range(6)]
        assert {v.refusal for v in refused} == {"circuit_open"}
        assert all(0 < v.retry_after_ms <= 400 for v in refused)
        assert (await limiters[0].admit(Admission("other", "fast"))).allowed  # its own breaker

        await asyncio.sleep(0.45)  # the cool-down ends: step 1 (10 %)
        step1 = [(await admit(i)).allowed for i in range(30)]
        assert step1.count(True) == 3 and step1[0] and step1[10] and step1[20]
        await asyncio.sleep((await redis_ms(resp, "o") + 1500 - await redis_ms(resp)) / 1000)
        await asyncio.sleep(0.02)  # into step 2 (30 %)
        step2 = [(await admit(i)).allowed for i in range(20)]
        assert step2.count(True) == 6
    finally:
        await resp.close()


async def redis_ms(resp: Resp, field: str = "") -> int:
    """Redis's time (ms), or a field of the shared breaker."""
    if field:
        value = await resp.call("HGET", breaker_key("shared"), field)
        assert isinstance(value, bytes)
        return int(value)
    reply = await resp.call("TIME")
    assert isinstance(reply, list) and all(isinstance(v, bytes) for v in reply)
    return int(reply[0]) * 1000 + int(reply[1]) // 1000  # type: ignore[arg-type]


def outcome(tenant: str, status: int, tier: str = "fast") -> Outcome:
    return Outcome(
        request_id=f"r-{time.monotonic_ns()}",
        ts=datetime.now(UTC),
        tenant=tenant,
        tier=tier,
        status=status,
        outcome="upstream_error" if status >= 500 else "ok",
    )


async def test_the_feed_records_trips_and_recoveries_and_alerts_its_tier(resp: Resp) -> None:
    alerting = FAST.model_copy(update={"alert": True})
    table = TierTable(tiers={"fast": TierSpec(breaker=FAST), "loud": TierSpec(breaker=alerting)})
    events: list[tuple[str, str, dict[str, Any], datetime | None]] = []
    alerts: list[tuple[str, str]] = []

    class Sink:
        def submit_event(
            self, kind: str, tenant: str = "", detail: Any = None, ts: datetime | None = None
        ) -> None:
            events.append((kind, tenant, dict(detail or {}), ts))

    def alert(kind: str, *, tenant: str = "", tier: str = "", detail: Any = None) -> None:
        alerts.append((kind, tenant))

    breakers = Breakers(lambda: table, Sink(), alert)
    batch = [
        outcome("a", 200),
        *[outcome("a", 500), outcome("b", 500, "loud")] * 2,
        outcome("c", 200),
    ]
    trips = await breakers.feed(resp, batch)
    breakers.record(trips)
    assert sorted((t.kind, t.tenant) for t in trips) == [("trip", "a"), ("trip", "b")]
    assert alerts == [("platinum_breaker_open", "b")]  # only the tier that asks for it
    await asyncio.sleep(0.12 + 3 * 0.08 + 0.02)  # cool-down and every step: recovered
    (recovered,) = await breakers.feed(resp, [outcome("a", 200)])
    breakers.record([recovered])
    assert recovered.kind == "recover"
    first = next(t for t in trips if t.tenant == "a")
    assert recovered.at_ms - recovered.first_ms == 120 + 3 * 80 == recovered.at_ms - first.at_ms
    kind, tenant, detail, ts = events[-1]
    assert (kind, tenant, detail["recovered_after_s"]) == ("breaker.recover", "a", 0.36)
    assert ts is not None and round(ts.timestamp() * 1000) == recovered.at_ms
    assert [e[0] for e in events[:2]] == ["breaker.trip"] * 2


def test_the_refusal_tells_the_sdk_to_retry_only_within_its_longest_wait() -> None:
    def verdict(wait_ms: int) -> Verdict:
        return Verdict("t", "free", "circuit_open", None, None, None, wait_ms, False)

    headers, body = circuit_open(verdict(119_500))
    assert dict(headers)["x-should-retry"] == "true"
    assert (dict(headers)["retry-after"], dict(headers)["retry-after-ms"]) == ("120", "119500")
    assert b'"code":"tenant_circuit_open"' in body and b'"type":"server_error"' in body
    headers, _ = circuit_open(verdict(240_000))
    assert dict(headers)["x-should-retry"] == "false"


async def test_failures_that_are_the_fleets_or_the_pods_trip_no_one(resp: Resp) -> None:
    """Two failures trip FAST, unless they are the fleet's (Envoy's flags) or their pod failed
    three tenants at once (ledger/blame.py)."""
    table = TierTable(tiers={"fast": TierSpec(breaker=FAST)})
    breakers = Breakers(lambda: table, None, None)
    pod = "10.0.0.9:8000"
    one_pod = [
        outcome(t, 500).model_copy(update={"pod": pod}) for t in ("p1", "p2", "p3") for _ in "12"
    ]
    assert await breakers.feed(resp, one_pod) == []
    reset = [outcome("f1", 200).model_copy(update={"flags": "UC", "outcome": "upstream_error"})]
    no_pod = [outcome("f1", 503).model_copy(update={"flags": "UF,URX"})]
    assert await breakers.feed(resp, (reset + no_pod) * 2) == []
    trips = await breakers.feed(resp, [outcome("own", 500)] * 2)  # no other tenant failed
    assert [(t.tenant, t.cause) for t in trips] == [("own", "500")]
