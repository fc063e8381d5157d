"""The decision with in-process counters and a simulated clock."""

from __future__ import annotations

import random

from llmgw.fleetload import FleetLoad
from llmgw.tiers import Budget, PerUnit, TenantSpec, TierSpec, TierTable
from ratelimit.fleet import IDLE_UNKNOWN
from ratelimit.limiter import Limiter, retry_after_ms
from ratelimit.limits import Limits
from ratelimit.store import LocalStore
from ratelimit.types import Admission

NOW = 1_800_000_000.0  # a multiple of 10 s: bucket boundaries are easy to reason about


class Env:
    def __init__(self, config: TierTable, fleet: FleetLoad = IDLE_UNKNOWN, ttl_s: float = 300):
        self.now = NOW
        self.fleet = fleet
        self.store = LocalStore()
        self.limiter = Limiter(
            Limits(config).policy,
            self.store,
            lambda: self.fleet,
            lambda: self.now,
            reservation_ttl_s=ttl_s,
            rng=random.Random(7),
        )


def tier(**kw: object) -> TierTable:
    return TierTable(tiers={"t": TierSpec(**kw)}, default_tier="t")  # type: ignore[arg-type]


async def admit_n(env: Env, n: int, **kw: object) -> int:
    ok = 0
    for _ in range(n):
        verdict = await env.limiter.admit(Admission("acme", "t", **kw))  # type: ignore[arg-type]
        ok += verdict.allowed
    return ok


async def test_requests_up_to_the_limit_then_refused_until_the_window_slides() -> None:
    env = Env(tier(requests=PerUnit(minute=5)))
    assert await admit_n(env, 8) == 5
    verdict = await env.limiter.admit(Admission("acme", "t"))
    assert verdict.refusal == "requests"
    assert verdict.refused is not None and verdict.refused.used == 5
    # All 5 sit in bucket [NOW, NOW+10). From NOW+60 it decays (windows.py): ⌈5 × 0.8⌉ = 4 at
    # NOW+62 leaves room for one; from NOW+70 it is gone.
    assert verdict.retry_after_ms >= 62_000
    env.now = NOW + 61.9
    assert await admit_n(env, 1) == 0
    env.now = NOW + 62.0
    assert await admit_n(env, 2) == 1
    env.now = NOW + 70.0
    assert await admit_n(env, 6) == 4


async def test_sliding_window_counts_the_last_six_buckets() -> None:
    env = Env(tier(requests=PerUnit(minute=4)))
    for step in range(4):  # one request in each of four buckets
        env.now = NOW + 10 * step
        assert await admit_n(env, 1) == 1
    env.now = NOW + 55
    assert await admit_n(env, 1) == 0
    verdict = await env.limiter.admit(Admission("acme", "t"))
    assert verdict.retry_after_ms >= 15_000  # the oldest bucket decays to 0 by NOW+70
    env.now = NOW + 65
    assert await admit_n(env, 1) == 0  # ⌈1 × 0.5⌉ still counts it
    env.now = NOW + 70
    assert await admit_n(env, 2) == 1


async def test_per_second_limit_uses_100ms_buckets() -> None:
    env = Env(tier(requests=PerUnit(second=3, minute=100)))
    assert await admit_n(env, 5) == 3
    env.now = NOW + 1.0
    assert await admit_n(env, 1) == 0  # the first bucket decays from here
    env.now = NOW + 1.05
    assert await admit_n(env, 5) == 1  # ⌈3 × 0.5⌉ = 2 of it left
    env.now = NOW + 1.1
    assert await admit_n(env, 5) == 2


async def test_tokens_reserve_the_estimate_and_refuse_when_it_does_not_fit() -> None:
    env = Env(tier(tokens=PerUnit(minute=1000)))
    first = await env.limiter.admit(Admission("acme", "t", request_id="a", token_estimate=600))
    assert first.allowed and first.tokens is not None and first.tokens.remaining == 400
    second = await env.limiter.admit(Admission("acme", "t", request_id="b", token_estimate=500))
    assert second.refusal == "tokens"
    assert second.refused is not None and (second.refused.used, second.refused.requested) == (
        600,
        500,
    )
    # A refused admission counts nothing, not even the request.
    assert second.requests is None or second.requests.used == 1


async def test_an_unsettled_reservation_stays_charged() -> None:
    """Only the ledger's settlement gives tokens back; a reservation never expires into a refund."""
    env = Env(tier(tokens=PerUnit(hour=1000)), ttl_s=30)
    await env.limiter.admit(Admission("acme", "t", request_id="lost", token_estimate=1000))
    env.now = NOW + 3000  # far past the reservation's TTL, inside the hour
    assert (await env.limiter.admit(Admission("acme", "t", token_estimate=1))).refusal == "tokens"


async def test_shadow_mode_counts_but_never_refuses() -> None:
    env = Env(tier(requests=PerUnit(minute=2), shadow=True))
    verdicts = [await env.limiter.admit(Admission("acme", "t")) for _ in range(4)]
    assert all(v.allowed for v in verdicts)
    assert verdicts[-1].refused is not None and verdicts[-1].refused.kind == "requests"
    assert verdicts[-1].requests is not None and verdicts[-1].requests.used == 4


async def test_tenant_override_and_unlimited() -> None:
    config = TierTable(
        tiers={"t": TierSpec(requests=PerUnit(minute=2))},
        default_tier="t",
        tenants={"big": TenantSpec(requests=PerUnit(minute="unlimited"))},
    )
    env = Env(config)
    assert await admit_n(env, 3) == 2
    big = [await env.limiter.admit(Admission("big", "t")) for _ in range(50)]
    assert all(v.allowed and v.requests is None for v in big)


async def test_hard_budget_is_insufficient_quota() -> None:
    env = Env(tier(tokens=PerUnit(minute=10_000), budget=Budget(tokens=1500, per="day")))
    assert (await env.limiter.admit(Admission("acme", "t", token_estimate=1000))).allowed
    verdict = await env.limiter.admit(Admission("acme", "t", token_estimate=1000))
    assert verdict.refusal == "insufficient_quota"
    assert verdict.retry_after_ms == 0


def fleet(load: float, age_s: float = 0.0) -> FleetLoad:
    return FleetLoad(load=load, capacity_tpm=0, capacity_rpm=1000, ts=NOW - age_s)


def test_retry_after_formula() -> None:
    assert retry_after_ms(2.0, 0.0, 0, 1.0) == 1_000  # clamped up to 1 s
    assert retry_after_ms(2.0, 0.7, 0, 1.0) == 2_000
    assert retry_after_ms(2.0, 1.4, 0, 1.2) == 4_800
    assert retry_after_ms(20.0, 1.0, 0, 1.2) == 30_000  # clamped down to 30 s
    assert retry_after_ms(1.0, 0.7, 45_000, 1.0) == 45_000  # never before the window frees


async def test_refusal_retry_after_within_jitter_bounds() -> None:
    env = Env(tier(requests=PerUnit(second=1), retry_base_s=2.0), fleet(1.0))
    await admit_n(env, 1)
    waits = {(await env.limiter.admit(Admission("acme", "t"))).retry_after_ms for _ in range(20)}
    base = 2000 * (1.0 / 0.7)
    assert all(0.8 * base - 1 <= w <= 1.2 * base + 1 for w in waits) and len(waits) > 1
