"""Money budgets: a request reserved at its worst-case price, the cap lowered to what the budget
pays for, then insufficient_quota, settled at its cost: exact in admit.lua's doubles, in the
in-process store alike, per UTC day and calendar month."""

from __future__ import annotations

import asyncio
import random
import time
from datetime import UTC, datetime
from decimal import Decimal

import pytest

from llmgw.prices import ModelPrice, Prices
from llmgw.reservation import with_prelude
from llmgw.resp import Resp
from llmgw.settlement import Charge, settle
from llmgw.tiers import PerUnit, Spend, TierSpec, TierTable, month_index, month_start
from llmgw.wire import tenant_prefix
from ratelimit.fleet import IDLE_UNKNOWN
from ratelimit.limiter import Limiter
from ratelimit.limits import Limits
from ratelimit.redis_store import RedisStore
from ratelimit.response import refusal
from ratelimit.store import LocalStore, Store
from ratelimit.types import MAX_PER_CAP, Admission, Check, Grant, Period
from ratelimit.windows import period

PREFIX = tenant_prefix("acme")
DAY = period(Period.DAY)


@pytest.fixture(params=["redis", "local"])
def store(request: pytest.FixtureRequest, resp: Resp) -> Store:
    return RedisStore(resp) if request.param == "redis" else LocalStore()


def money_check(limit: int, cost: int, per: Period = Period.DAY) -> Check:
    """A money budget's check as the limiter builds it: reserving, capping, in micro-units."""
    return Check(f"spend:{per}", period(per), limit, cost, True, True, True)


async def test_a_money_budget_lowers_the_cap_to_what_it_pays_for_then_refuses(
    store: Store,
) -> None:
    # A prompt of 1,000 tokens at 2 micro-units each, 2 sequences at 7.5 each per output token.
    grant = Grant(prompt=1000, sequences=2, base=2000, per_cap=2 * 7_500_000)
    want = grant.money_cost(500)  # 2,000 + 500 × 15 = 9,500
    assert want == 9_500
    first = await store.admit(PREFIX, [money_check(10_000, want)], 0, grant=grant)
    assert first.admitted and first.cap == 0  # fits at its own cap
    # 500 left: (500 − 2,000) < 0: not even the prompt is paid for.
    second = await store.admit(PREFIX, [money_check(10_000, want)], 0, grant=grant)
    assert not second.admitted and second.cap == 0
    other = tenant_prefix("other")
    lowered = await store.admit(other, [money_check(4_000, want)], 0, grant=grant)
    # ⌊(4,000 − 2,000) / 15⌋ = 133 tokens a sequence, charged 2,000 + ⌈133 × 15⌉ = 3,995.
    assert lowered.admitted and lowered.cap == 133
    after = await store.admit(other, [money_check(4_000, 0)], 0)
    assert after.counts[0][0] == 3_995


async def test_without_money_parts_a_money_budget_refuses_what_does_not_fit(store: Store) -> None:
    grant = Grant(prompt=10, sequences=1)  # per_cap 0: no money lowering
    refused = await store.admit(PREFIX, [money_check(100, 150)], 0, grant=grant)
    assert not refused.admitted and refused.cap == 0
    # A per-token price too fine for Lua's exact division is never used to lower a cap.
    assert Grant(10, 1, base=1, per_cap=MAX_PER_CAP).per_cap == 0


async def test_lua_and_python_lower_and_charge_alike_at_extreme_sizes(resp: Resp) -> None:
    """Budgets up to 2^48 micro-units, per-token prices up to 2^43 − 1 millionths: admit.lua's
    long division gives the exact cap and cost Python's integers give (each tenant fresh)."""
    rng = random.Random(7)
    redis = RedisStore(resp)
    for i in range(300):
        limit = rng.choice(
            [rng.randrange(1, 10**4), rng.randrange(1, 10**9), rng.randrange(1, 2**48)]
        )
        used = rng.randrange(0, limit)
        base = rng.randrange(0, limit - used + 1)
        per_cap = rng.choice([1, rng.randrange(1, 10**6), rng.randrange(1, MAX_PER_CAP)])
        grant = Grant(prompt=1, sequences=1, base=base, per_cap=per_cap)
        prefix = tenant_prefix(f"x{i}")
        if used:
            assert (await redis.admit(prefix, [money_check(limit, used)], 0)).admitted
        left = limit - used
        expected = grant.money_cap(left)
        if expected >= 2**40:  # above any request's cap: such a request fits, never lowered
            continue
        ask = expected + 1 + rng.randrange(0, 1000)  # does not fit: the cap is lowered
        got = await redis.admit(prefix, [money_check(limit, grant.money_cost(ask))], 0, grant=grant)
        assert got.cap == (expected if expected >= 1 else 0), (limit, used, base, per_cap)
        assert got.admitted == (expected >= 1)
        if got.admitted:
            held = (await redis.admit(prefix, [money_check(limit, 0)], 0)).counts[0][0]
            assert held == used + grant.money_cost(expected) <= limit


async def test_token_and_money_budgets_grant_the_least_cap_and_charge_each_its_own(
    store: Store,
) -> None:
    grant = Grant(prompt=100, sequences=1, base=100, per_cap=3_000_000)  # 3 micro a token
    checks = [
        Check("budget:day", DAY, 10_000, 100 + 1000, True, True),
        money_check(1_000, grant.money_cost(1000)),  # 3,100 > 1,000: pays for 300 tokens
    ]
    got = await store.admit(PREFIX, checks, 0, reservation="r", ttl_ms=60_000, grant=grant)
    assert got.admitted and got.cap == 300
    after = await store.admit(PREFIX, [checks[0], money_check(1_000, 0)], 0)
    assert (after.counts[0][0], after.counts[1][0]) == (100 + 300, 1_000)


async def test_concurrent_money_grants_never_overspend(resp: Resp) -> None:
    """200 requests at once against $0.05: the reservations add up to at most the budget."""
    store = RedisStore(resp)
    rng = random.Random(3)

    async def one(i: int) -> int:
        prompt, n = rng.randrange(1, 300), rng.randrange(1, 3)
        grant = Grant(prompt, n, base=prompt * 2, per_cap=n * 8_000_000)
        cost = grant.money_cost(400)
        got = await store.admit(
            PREFIX, [money_check(50_000, cost)], 0, reservation=f"r{i}", ttl_ms=60_000,
            grant=grant,
        )  # fmt: skip
        if not got.admitted:
            return 0
        return grant.money_cost(got.cap) if got.cap else cost

    spent = await asyncio.gather(*(one(i) for i in range(200)))
    assert sum(spent) <= 50_000 and sum(spent) > 50_000 - 8 * 400 * 2
    held = (await store.admit(PREFIX, [money_check(50_000, 0)], 0)).counts[0][0]
    assert held == sum(spent)
    assert await resp.call("HGET", f"{PREFIX}:res:r0", "m") == str(spent[0]).encode()


async def test_settlement_refunds_the_money_reserved_and_reports_the_costs_settled(
    resp: Resp,
) -> None:
    store = RedisStore(resp)
    checks = [Check("budget:day", DAY, 10_000, 500, True, True), money_check(90_000, 40_000)]
    for rid in ("s1", "s2"):
        assert (await store.admit(PREFIX, checks, 0, reservation=rid, ttl_ms=60_000)).admitted
    [done] = await settle(resp, [Charge("acme", "s1", 120, cost_micros=12_345)], 60_000)
    assert (done.state, done.reserved, done.charged) == (1, 500, 120)
    # The costs settled, not s2's reservation still outstanding: what the soft limits read, with
    # the day they were charged to.
    [(name, day, settled)] = done.spent
    assert (name, settled) == ("spend:day", 12_345) and day == time.time_ns() // 86_400 // 10**9
    held = (await store.admit(PREFIX, [checks[0], money_check(90_000, 0)], 0)).counts
    assert (held[0][0], held[1][0]) == (120 + 500, 12_345 + 40_000)
    [again] = await settle(resp, [Charge("acme", "s1", 120, cost_micros=12_345)], 60_000)
    assert again.state == 2 and again.spent == ()
    [second] = await settle(resp, [Charge("acme", "s2", 0, cost_micros=0)], 60_000)
    assert second.spent == (("spend:day", day, 12_345),)  # released: nothing spent


async def test_calendar_months_in_lua_are_pythons(resp: Resp) -> None:
    """rs_month and rs_month_start (llmgw/reservation.lua) against the calendar, over leap years,
    month ends and centuries."""
    script = with_prelude(
        "local ms = tonumber(ARGV[1]) local i = rs_month(ms) local f = string.format "
        "return {i, f('%d', rs_month_start(i)), f('%d', rs_month_start(i + 1))}"
    )
    rng = random.Random(1)
    instants = [
        int(datetime(y, m, d, tzinfo=UTC).timestamp() * 1000) + off
        for y, m, d in [(2000, 2, 29), (2024, 2, 29), (2100, 3, 1), (2026, 12, 31), (1999, 12, 31)]
        for off in (-1, 0, 1, 86_399_999)
    ] + [rng.randrange(0, 4_102_444_800_000) for _ in range(200)]
    for ms in instants:
        index, start, end = await resp.call("EVAL", script, 0, ms)  # type: ignore[misc]
        assert index == month_index(ms)
        assert int(start) == month_start(index) <= ms < int(end) == month_start(index + 1)


async def test_a_month_window_counts_until_the_month_ends() -> None:
    """At the caller's clock (the in-process store's; Redis decides at its own time, and its
    months are checked against the calendar above)."""
    store = LocalStore()
    at = int(datetime(2026, 2, 27, 12, tzinfo=UTC).timestamp() * 1000)
    assert (await store.admit(PREFIX, [money_check(100, 60, Period.MONTH)], at)).admitted
    march = int(datetime(2026, 3, 1, tzinfo=UTC).timestamp() * 1000)
    assert not (await store.admit(PREFIX, [money_check(100, 60, Period.MONTH)], march - 1)).admitted
    assert (await store.admit(PREFIX, [money_check(100, 60, Period.MONTH)], march)).admitted


def spend_limiter(resp: Resp, **spend: object) -> Limiter:
    prices = Prices(
        models={
            "cheap": ModelPrice(input=Decimal("0.5"), output=Decimal("2")),
            "dear": ModelPrice(input=Decimal("3"), cached_input=Decimal("1"), output=Decimal("15")),
        }
    )
    spec = TierSpec(
        requests=PerUnit(minute=10_000),
        tokens=PerUnit(minute=10**9),
        spend=Spend.model_validate(spend),
        borrow_share=1.0,
    )
    table = TierTable(tiers={"t": spec}, default_tier="t", prices=prices)
    return Limiter(Limits(table).policy, RedisStore(resp), lambda: IDLE_UNKNOWN, time.time)


async def test_the_limiter_prices_the_worst_case_lowers_then_refuses(resp: Resp) -> None:
    engine = spend_limiter(resp, day="0.01")  # 10,000 micro-units
    # 400 prompt tokens (ceiling 500) at 3, and 2 × 300 output tokens at 15: 1,500 + 9,000.
    ask = Admission(
        "acme", "t", request_id="a", token_estimate=400 + 2 * 300, grant=Grant(400, 2),
        model="dear", prompt_ceiling=500,
    )  # fmt: skip
    lowered = await engine.admit(ask)
    # ⌊(10,000 − 1,500) / 30⌋ = 283 a sequence.
    assert lowered.allowed and lowered.output_cap == 283
    refused = await engine.admit(ask)
    assert refused.refusal == "insufficient_quota" and refused.refused is not None
    assert refused.refused.kind == "spend" and refused.refused.unit is Period.DAY
    headers, body = refusal(refused)
    assert b"insufficient_quota" in body and b"0.01 per day" in body
    assert ("x-should-retry", "false") in headers
    # Without a model named (Envoy's descriptors from an older config): the dearest prices.
    other = Admission("bob", "t", token_estimate=400 + 2 * 100, grant=Grant(400, 2))
    assert (await engine.admit(other)).output_cap == 0
    day = time.time_ns() // 86_400_000_000_000
    held = await resp.call("GET", f"{tenant_prefix('bob')}:spend:day:{day}")
    assert held == str(400 * 3 + 2 * 100 * 15).encode()


async def test_a_tenant_without_a_money_budget_is_not_priced(resp: Resp) -> None:
    engine = spend_limiter(resp)
    verdict = await engine.admit(
        Admission("acme", "t", token_estimate=10**6, grant=Grant(10, 1), model="dear")
    )
    assert verdict.allowed
    assert await resp.call("KEYS", f"{PREFIX}:spend:*") == []


async def test_a_money_budget_never_borrows(resp: Resp) -> None:
    """Spent is spent: a tier that borrows rate limits cannot borrow money."""
    engine = spend_limiter(resp, month="0.0009")
    ask = Admission("acme", "t", token_estimate=1000, grant=Grant(1000, 1), model="cheap")
    verdict = await engine.admit(ask)  # 1,000 prompt tokens at 0.5: 500 of 900
    assert verdict.allowed
    assert (await engine.admit(ask)).allowed is False


async def test_a_request_settled_after_midnight_is_charged_to_the_day_that_admitted_it(
    resp: Resp,
) -> None:
    """Admitted at 23:59 with the whole budget, settled after midnight: its cost stays in the
    day it was admitted in, never on top of the next day's budget."""
    store = RedisStore(resp)
    today = time.time_ns() // 86_400 // 10**9
    assert (
        await store.admit(
            PREFIX, [money_check(10_000, 10_000)], 0, reservation="old", ttl_ms=60_000
        )
    ).admitted
    # As if admitted yesterday: the bucket and the reservation moved one day back.
    await resp.call("RENAME", f"{PREFIX}:spend:day:{today}", f"{PREFIX}:spend:day:{today - 1}")
    spec = await resp.call("HGET", f"{PREFIX}:res:old", "s")
    assert isinstance(spec, bytes)
    moved = spec.decode().replace(f" {today}", f" {today - 1}")
    await resp.call("HSET", f"{PREFIX}:res:old", "s", moved)
    assert (
        await store.admit(
            PREFIX, [money_check(10_000, 10_000)], 0, reservation="new", ttl_ms=60_000
        )
    ).admitted
    [done] = await settle(resp, [Charge("acme", "old", 100, cost_micros=9_000)], 60_000)
    assert done.spent == (("spend:day", today - 1, 9_000),)
    assert await resp.call("GET", f"{PREFIX}:spend:day:{today - 1}") == b"9000"
    assert await resp.call("GET", f"{PREFIX}:spend:day:{today}") == b"10000"


async def test_a_token_budgets_lower_cap_keeps_the_money_worst_case_without_money_parts(
    store: Store,
) -> None:
    """A per-token price too fine to lower a cap exactly (per_cap dropped): when a token budget
    lowers the cap, the money check still holds the request's own worst case, never only the
    prompt's."""
    grant = Grant(prompt=100, sequences=9, base=100, per_cap=MAX_PER_CAP + 5)
    assert grant.per_cap == 0
    worst = 100 + 9 * 1000 * 1_000_000  # 9 sequences of 1,000 tokens at 10^6 micro-units
    checks = [
        Check("budget:day", DAY, 1_000, 100 + 9 * 1000, True, True),
        money_check(10**11, worst),
    ]
    got = await store.admit(PREFIX, checks, 0, grant=grant)
    assert got.admitted and got.cap == 100  # the token budget's: (1,000 − 100) / 9
    after = await store.admit(PREFIX, [money_check(10**11, 0)], 0)
    assert after.counts[0][0] == worst
