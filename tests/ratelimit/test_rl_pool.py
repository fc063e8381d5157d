"""The fleet's borrowing pool against a real redis-server: shared, bounded, by tier and window."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence

import pytest

from llmgw import wire
from llmgw.fleetload import FleetLoad
from llmgw.resp import Client, Resp
from llmgw.tiers import Budget, PerUnit, TierSpec, TierTable
from ratelimit.descriptors import Parsed
from ratelimit.fleet import IDLE_UNKNOWN, parse
from ratelimit.limiter import Limiter
from ratelimit.limits import Limits
from ratelimit.pool import Draw, Pool, size
from ratelimit.redis_store import RedisStore
from ratelimit.service import to_response
from ratelimit.store import Store
from ratelimit.types import Admission, Check, Grant, StoreResult, Unit, Verdict
from ratelimit.windows import SLIDING

BASE = PerUnit(minute=10)
TABLE = TierTable(
    tiers={
        "platinum": TierSpec(requests=BASE, borrow_share=1.0),
        "standard": TierSpec(requests=BASE, borrow_share=0.5),
        "free": TierSpec(requests=BASE, borrow_share=0.0),
        "daily": TierSpec(tokens=PerUnit(day=1000), borrow_share=1.0),
        "budgeted": TierSpec(budget=Budget(tokens=100), borrow_share=1.0),
        "mixed": TierSpec(requests=PerUnit(minute=2), tokens=PerUnit(minute=100), borrow_share=1.0),
    }
)
# Requests pool per minute: 1000 rpm × (0.7 − 0.2) × 0.8 = 400; tokens: 10 000 × 0.4 = 4000.
POOL_RPM = 400


def idle(load: float = 0.2, age_s: float = 0.0, rpm: int = 1000) -> FleetLoad:
    return FleetLoad(load=load, capacity_tpm=10_000, capacity_rpm=rpm, ts=time.time() - age_s)


def limiter(
    resp: Client,
    fleet: FleetLoad,
    store: Store | None = None,
    clock: Callable[[], float] = time.time,
) -> Limiter:
    return Limiter(
        Limits(TABLE).policy,
        store or RedisStore(resp),
        lambda: fleet,
        clock,
        pool=Pool(lambda: resp, deadline_s=2.0),
    )


async def redis_ms(resp: Resp) -> int:
    reply = await resp.call("TIME")
    assert isinstance(reply, list)
    seconds, micros = (int(v) for v in reply if isinstance(v, bytes))
    return seconds * 1000 + micros // 1000


async def pool_use(resp: Resp, window: str) -> int:
    keys = await resp.call("KEYS", f"{wire.POOL_PREFIX}:{window}:*")
    assert isinstance(keys, list)
    if not keys:
        return 0
    values = await resp.call("MGET", *[k for k in keys if isinstance(k, bytes)])
    assert isinstance(values, list)
    return sum(int(v) for v in values if isinstance(v, bytes))


async def burst(engine: Limiter, tier: str, tenants: int, each: int) -> list[Verdict]:
    """`each` requests of every tenant, all at once."""
    return await asyncio.gather(
        *(engine.admit(Admission(f"{tier}-{t}", tier)) for t in range(tenants) for _ in range(each))
    )


def test_pool_size_per_window() -> None:
    fleet = idle(load=0.2, rpm=6000)  # idle per minute: 6000 × 0.5 × 0.8 = 2400
    sizes = {unit: size(fleet, 0.2, "requests", unit) for unit in Unit}
    # A day (or an hour) borrows at most the minute's idle capacity, a second its 60th.
    assert sizes == {Unit.SECOND: 40, Unit.MINUTE: 2400, Unit.HOUR: 2400, Unit.DAY: 2400}
    assert size(fleet, 0.7, "requests", Unit.MINUTE) == 0
    assert size(IDLE_UNKNOWN, 0.2, "tokens", Unit.MINUTE) == 0  # capacity unknown


async def test_ten_tenants_borrowing_at_once_never_exceed_the_pool(resp: Resp) -> None:
    verdicts = await burst(limiter(resp, idle()), "platinum", tenants=10, each=100)
    borrowed = sum(v.borrowed_requests for v in verdicts)
    assert borrowed == POOL_RPM == await pool_use(resp, "requests:minute")
    # Every tenant got its base, and the borrowed ones are exactly the pool, no more.
    assert sum(v.allowed for v in verdicts) == 10 * 10 + POOL_RPM
    assert all(v.borrowed_requests in (0, 1) for v in verdicts)
    assert not any(v.borrowed_requests for v in verdicts if not v.allowed)


async def test_replicas_with_skewed_clocks_share_one_pool_exactly(resp: Resp) -> None:
    """Two replicas whose clocks are more than a window apart: the pool follows Redis's time, so
    together they borrow exactly the pool (a replica's own clock would put its draws in buckets
    the other never reads)."""
    now = time.time()
    engines = [
        limiter(resp, idle(), clock=lambda: now - 61.0),
        limiter(resp, idle(), clock=lambda: now + 1.0),
    ]
    verdicts = await asyncio.gather(
        *(engines[i % 2].admit(Admission(f"platinum-{i % 4}", "platinum")) for i in range(800))
    )
    assert sum(v.borrowed_requests for v in verdicts) == POOL_RPM
    assert await pool_use(resp, "requests:minute") == POOL_RPM


async def test_a_draw_decays_out_of_the_pool_as_the_tenants_windows_decay(resp: Resp) -> None:
    """What was drawn in the bucket just before the window still counts, weighted by how much of
    it is inside, rounded up (aligned buckets alone had forgotten it); a bucket drawn into lives
    N + 2 buckets."""
    w = SLIDING[Unit.MINUTE]
    b = w.bucket_ms
    now = await redis_ms(resp)
    if not 500 <= now % b <= b - 1_000:  # room for the calls below inside one bucket
        await asyncio.sleep((b - now % b + 500) / 1000)
        now = await redis_ms(resp)
    decaying = now // b - w.buckets
    await resp.call("SET", f"{wire.POOL_PREFIX}:requests:minute:{decaying}", POOL_RPM)
    pool = Pool(lambda: resp, deadline_s=2.0)
    assert await pool.draw(idle(), 0.2, 1.0, [Draw("requests", Unit.MINUTE, POOL_RPM)]) is None
    # The decaying share only shrinks from here, so the room seen now stays free.
    room = POOL_RPM - math.ceil(POOL_RPM * (b - now % b) / b)
    drawn = await pool.draw(idle(), 0.2, 1.0, [Draw("requests", Unit.MINUTE, room)])
    assert drawn is not None and drawn[0].bucket == str(decaying + w.buckets)
    ttl = await resp.call("PTTL", f"{wire.POOL_PREFIX}:requests:minute:{drawn[0].bucket}")
    assert isinstance(ttl, int) and (w.buckets + 1) * b < ttl <= (w.buckets + 2) * b


async def test_standard_stops_at_half_the_pool_and_platinum_takes_the_rest(resp: Resp) -> None:
    engine = limiter(resp, idle())
    standard = await burst(engine, "standard", tenants=10, each=100)
    assert sum(v.borrowed_requests for v in standard) == POOL_RPM // 2
    platinum = await burst(engine, "platinum", tenants=1, each=400)
    assert sum(v.borrowed_requests for v in platinum) == POOL_RPM - POOL_RPM // 2
    assert await pool_use(resp, "requests:minute") == POOL_RPM


async def test_free_never_borrows(resp: Resp) -> None:
    verdicts = await burst(limiter(resp, idle()), "free", tenants=3, each=30)
    assert sum(v.allowed for v in verdicts) == 3 * 10
    assert not any(v.borrowed_requests for v in verdicts)
    assert await resp.call("KEYS", f"{wire.POOL_PREFIX}:*") == []


async def test_a_day_limit_borrows_at_most_the_minute_equivalent(resp: Resp) -> None:
    engine = limiter(resp, idle())  # tokens pool: 4000 a minute, so 4000 a day too
    admitted = borrowed = 0
    for i in range(20):
        v = await engine.admit(Admission("acme", "daily", request_id=f"r{i}", token_estimate=1000))
        admitted += v.allowed
        borrowed += v.borrowed_tokens
    assert (admitted, borrowed) == (1 + 4, 4000)  # base 1000, then 4 × 1000 borrowed
    assert await pool_use(resp, "tokens:day") == 4000


@pytest.mark.parametrize(
    "fleet",
    [
        idle(load=0.7),  # busy
        idle(load=0.95),
        idle(age_s=10.0),  # stale signal: load 1
        IDLE_UNKNOWN,  # absent signal
        idle(rpm=0),  # capacity not measured yet
    ],
    ids=["load-0.7", "load-0.95", "stale", "absent", "no-capacity"],
)
async def test_no_borrowing_when_busy_stale_or_unknown(resp: Resp, fleet: FleetLoad) -> None:
    verdicts = await burst(limiter(resp, fleet), "platinum", tenants=2, each=20)
    assert sum(v.allowed for v in verdicts) == 2 * 10
    assert await resp.call("KEYS", f"{wire.POOL_PREFIX}:*") == []


async def test_hard_budgets_never_borrow(resp: Resp) -> None:
    engine = limiter(resp, idle())
    v = await engine.admit(Admission("acme", "budgeted", request_id="r", token_estimate=150))
    assert v.refusal == "insufficient_quota" and v.borrowed_tokens == 0
    assert await resp.call("KEYS", f"{wire.POOL_PREFIX}:*") == []


async def test_a_base_decision_never_calls_the_pool(resp: Resp) -> None:
    calls: list[int] = []

    def client() -> Resp:
        calls.append(1)
        return resp

    engine = limiter(resp, idle())
    engine.pool = Pool(client, deadline_s=2.0)
    assert all(v.allowed for v in await burst(engine, "platinum", tenants=1, each=10))
    assert calls == []
    assert (await engine.admit(Admission("platinum-0", "platinum"))).borrowed_requests == 1
    assert calls == [1]


class Interleaved:
    """A store that lets another admission of the same tenant in before the second admit."""

    def __init__(self, inner: RedisStore, between: Admission) -> None:
        self.inner = inner
        self.between = between
        self.calls = 0

    async def admit(
        self,
        prefix: str,
        checks: Sequence[Check],
        now_ms: int,
        *,
        shadow: bool = False,
        reservation: str = "",
        ttl_ms: int = 0,
        grant: Grant | None = None,
        breaker: str = "",
    ) -> StoreResult:
        self.calls += 1
        if self.calls == 2:
            direct = limiter(self.inner.client, IDLE_UNKNOWN)
            assert (await direct.admit(self.between)).allowed
        return await self.inner.admit(
            prefix,
            checks,
            now_ms,
            shadow=shadow,
            reservation=reservation,
            ttl_ms=ttl_ms,
            grant=grant,
            breaker=breaker,
        )


async def test_a_failed_second_admission_gives_the_draw_back(resp: Resp) -> None:
    base = limiter(resp, IDLE_UNKNOWN)
    assert (
        await base.admit(Admission("acme", "mixed", request_id="a", token_estimate=100))
    ).allowed
    # 1 of 2 requests and 100 of 100 tokens used: the next needs 50 borrowed tokens, and while it
    # borrows another request takes the last request of the minute.
    store = Interleaved(RedisStore(resp), Admission("acme", "mixed"))
    engine = limiter(resp, idle(), store=store)
    v = await engine.admit(Admission("acme", "mixed", request_id="b", token_estimate=50))
    assert store.calls == 2
    assert v.refusal == "tokens" and v.borrowed_tokens == 0
    assert await pool_use(resp, "tokens:minute") == 0  # drawn, then given back


async def test_borrowed_admissions_say_so_in_the_rls_response(resp: Resp) -> None:
    engine = limiter(resp, idle())
    verdicts = await burst(engine, "platinum", tenants=1, each=11)
    parsed = Parsed(roles=("requests",), admission=None)
    base, borrowed = verdicts[0], verdicts[-1]
    on_base = to_response(parsed, base).dynamic_metadata.fields
    assert base.borrowed_requests == 0 and set(on_base) == {wire.META_DECIDED}
    meta = to_response(parsed, borrowed).dynamic_metadata.fields
    assert borrowed.allowed
    assert meta[wire.META_BORROWED_REQUESTS].number_value == 1
    assert meta[wire.META_BORROWED_TOKENS].number_value == 0


def test_an_unreadable_capacity_is_no_signal() -> None:
    raw = b'{"load": 0.1, "ts": 1.0, "capacity_tpm": 1e400}'
    assert parse(raw) == IDLE_UNKNOWN


def test_fields_the_contract_does_not_name_are_ignored() -> None:
    """A router of another version (one wrote a nested `capacity` object) is read all the same:
    a rolling upgrade runs both."""
    raw = b'{"load": 0.3, "capacity": {"pods": 2}, "capacity_tpm": 60, "capacity_rpm": 6, "ts": 5}'
    assert parse(raw) == FleetLoad(load=0.3, capacity_tpm=60, capacity_rpm=6, ts=5.0)
