"""A hard budget lowers the output cap instead of refusing (admit.lua's grant), on a real
redis-server, and the in-process store decides alike."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2

from llmgw import wire
from llmgw.resp import Resp
from llmgw.tiers import Budget, PerUnit, TierSpec, TierTable
from llmgw.wire import tenant_prefix
from ratelimit.descriptors import parse
from ratelimit.fleet import IDLE_UNKNOWN
from ratelimit.limiter import Limiter
from ratelimit.limits import Limits
from ratelimit.redis_store import RedisStore
from ratelimit.service import to_response
from ratelimit.store import LocalStore, Store
from ratelimit.types import Admission, Check, Grant, Unit, Window
from ratelimit.windows import SLIDING, fixed

PREFIX = tenant_prefix("acme")
DAY = fixed(Unit.DAY)
MINUTE = SLIDING[Unit.MINUTE]


def checks(estimate: int, budget: int = 1000, tpm: int = 10**6, rpm: int = 1000) -> list[Check]:
    """A request's checks as the limiter builds them: one request, its tokens in a rate window
    and in a hard budget (the only check that may lower the cap)."""
    return [
        Check("requests:minute", MINUTE, rpm, 1),
        Check("tokens:minute", MINUTE, tpm, estimate, True),
        Check("budget:day", DAY, budget, estimate, True, True),
    ]


@pytest.fixture(params=["redis", "local"])
def store(request: pytest.FixtureRequest, resp: Resp) -> Store:
    return RedisStore(resp) if request.param == "redis" else LocalStore()


async def test_a_budget_with_less_left_than_the_estimate_admits_at_the_cap_that_fits(
    store: Store, resp: Resp
) -> None:
    grant = Grant(prompt=100, sequences=2)  # estimate 100 + 500 × 2
    first = await store.admit(PREFIX, checks(1100), 0, reservation="r1", ttl_ms=60_000, grant=grant)
    assert first.admitted and first.cap == 450  # ⌊(1000 − 100) / 2⌋
    # Reserved at the granted cost in every token window; the request still counts once.
    second = await store.admit(PREFIX, checks(0), first.now_ms)
    assert [c[0] for c in second.counts] == [1, 1000, 1000]
    if isinstance(store, RedisStore):
        assert await resp.call("HGET", f"{PREFIX}:res:r1", "n") == b"1000"
    # Spent: not even the prompt and one token per sequence fit, so nothing is granted.
    third = await store.admit(PREFIX, checks(1100), first.now_ms, grant=grant)
    assert not third.admitted and third.cap == 0


async def test_the_least_grant_is_one_token_per_sequence(store: Store) -> None:
    grant = Grant(prompt=10, sequences=3)
    assert (await store.admit(PREFIX, checks(987, budget=1000), 0)).admitted  # 13 left
    edge = await store.admit(PREFIX, checks(10 + 3 * 50), 0, grant=grant)
    assert edge.admitted and edge.cap == 1  # 10 + 1 × 3 = 13
    after = await store.admit(PREFIX, checks(0), 0)
    assert after.counts[2][0] == 1000

    other = tenant_prefix("other")
    assert (await store.admit(other, checks(988, budget=1000), 0)).admitted  # 12 left
    short = await store.admit(other, checks(10 + 3 * 50), 0, grant=grant)
    assert not short.admitted and short.cap == 0
    assert (await store.admit(other, checks(0), 0)).counts[2][0] == 988  # nothing added


async def test_without_a_grant_or_a_capping_check_the_budget_refuses(store: Store) -> None:
    grant = Grant(prompt=100, sequences=1)
    no_grant = await store.admit(PREFIX, checks(1100), 0)
    assert not no_grant.admitted and no_grant.cap == 0
    rate_only = [Check("tokens:minute", MINUTE, 1000, 1100, True)]  # a rate window never caps
    refused = await store.admit(PREFIX, rate_only, 0, grant=grant)
    assert not refused.admitted and refused.cap == 0


async def test_rate_windows_are_tested_at_the_granted_cost(store: Store) -> None:
    """The cost the windows are charged is the one they are tested at: a TPM of 1,000 refuses
    the request's own 1,100 but holds the 1,000 the budget grants; a TPM below that refuses."""
    grant = Grant(prompt=100, sequences=1)
    fits = await store.admit(PREFIX, checks(1100, tpm=1000), 0, grant=grant)
    assert fits.admitted and fits.cap == 900
    other = tenant_prefix("other")
    tight = await store.admit(other, checks(1100, tpm=999), 0, grant=grant)
    assert not tight.admitted
    assert (await store.admit(other, checks(0), 0)).counts == ((0,) * 7, (0,) * 7, (0,))


async def test_concurrent_grants_never_overcommit_the_budget(resp: Resp) -> None:
    """Atomic: 60 requests at once against a budget of 5,000, each asking 100 + 400 × n; the
    reservations add up to at most the budget, and every admitted one fits its grant."""
    store = RedisStore(resp)
    rng = random.Random(5)
    shapes = [(rng.randrange(1, 200), rng.randrange(1, 4)) for _ in range(60)]

    async def one(i: int, prompt: int, n: int) -> tuple[bool, int, int, int]:
        estimate = prompt + 400 * n
        got = await store.admit(
            PREFIX, checks(estimate, budget=5000), 0, reservation=f"r{i}", ttl_ms=60_000,
            grant=Grant(prompt, n),
        )  # fmt: skip
        cost = prompt + got.cap * n if got.cap else estimate
        return got.admitted, got.cap, cost, n

    results = await asyncio.gather(*(one(i, p, n) for i, (p, n) in enumerate(shapes)))
    admitted = [r for r in results if r[0]]
    reserved = 0
    for i, (ok, _, cost, _) in enumerate(results):
        stored = await resp.call("HGET", f"{PREFIX}:res:r{i}", "n")
        assert (stored is not None) == ok
        if ok:
            assert stored == str(cost).encode()
            reserved += cost
    assert reserved <= 5000
    assert any(cap for _, cap, _, _ in admitted)  # some ran into the budget and were lowered
    assert all(cap < 400 for _, cap, _, _ in admitted if cap)
    probe = await store.admit(PREFIX, checks(0, budget=5000), 0)
    assert probe.counts[2][0] == reserved


async def test_redis_and_local_stores_grant_alike(resp: Resp) -> None:
    """Random admissions with grants against a small budget and a small rate window: both
    stores admit, grant and count the same (the local store at Redis's reported time)."""
    rng = random.Random(11)
    redis, local = RedisStore(resp), LocalStore()
    window = Window(2_000, 250)
    granted = set()
    for _ in range(150):
        await asyncio.sleep(rng.choice([0, 0, 0.005, 0.05]))
        prompt, n, cap = rng.randrange(0, 60), rng.randrange(1, 4), rng.randrange(1, 200)
        cost = prompt + cap * n
        these = [
            Check("tokens:w", window, 900, cost, True),
            Check("budget:b", Window(1_000, 1_000, rolling=False), 400, cost, True, True),
        ]
        grant = Grant(prompt, n) if rng.random() < 0.8 else None
        there = await redis.admit("p:{g}", these, 0, grant=grant)
        here = await local.admit("p:{g}", these, there.now_ms, grant=grant)
        assert (there.admitted, there.counts, there.cap) == (here.admitted, here.counts, here.cap)
        granted.add(there.cap > 0)
    assert granted == {True, False}


def limiter(resp: Resp, shadow: bool = False) -> Limiter:
    spec = TierSpec(
        requests=PerUnit(minute=1000),
        tokens=PerUnit(minute=10**6),
        budget=Budget(tokens=1000, per=Unit.DAY),
        shadow=shadow,
    )
    table = TierTable(tiers={"t": spec}, default_tier="t")
    return Limiter(Limits(table).policy, RedisStore(resp), lambda: IDLE_UNKNOWN, time.time)


async def test_the_verdict_carries_the_lowered_cap_then_insufficient_quota(resp: Resp) -> None:
    engine = limiter(resp)
    grant = Grant(prompt=200, sequences=1)
    full = await engine.admit(
        Admission("acme", "t", request_id="a", token_estimate=700, grant=grant)
    )
    assert full.allowed and full.output_cap == 0  # fits: the request's own cap (500) stands
    lowered = await engine.admit(
        Admission("acme", "t", request_id="b", token_estimate=700, grant=grant)
    )
    assert lowered.allowed and lowered.output_cap == 100  # 300 left − 200 of prompt
    assert lowered.tokens is not None and lowered.tokens.requested == 300
    spent = await engine.admit(
        Admission("acme", "t", request_id="c", token_estimate=700, grant=grant)
    )
    assert spent.refusal == "insufficient_quota" and spent.output_cap == 0


async def test_shadow_mode_never_lowers_a_cap(resp: Resp) -> None:
    engine = limiter(resp, shadow=True)
    grant = Grant(prompt=200, sequences=1)
    first = await engine.admit(Admission("acme", "t", token_estimate=900, grant=grant))
    second = await engine.admit(Admission("acme", "t", token_estimate=900, grant=grant))
    assert first.allowed and second.allowed  # shadow: counted, never enforced
    assert first.output_cap == second.output_cap == 0


def tokens_request(rid: str, estimate: int, *parts: tuple[str, str]) -> rls_pb2.RateLimitRequest:
    entries = [("kind", "tokens"), ("tenant", "acme"), ("tier", "t"), ("request_id", rid)]
    entries += [("token_estimate", str(estimate)), *parts]
    return rls_pb2.RateLimitRequest(
        domain=wire.RATELIMIT_DOMAIN,
        descriptors=[
            ratelimit_pb2.RateLimitDescriptor(
                entries=[
                    ratelimit_pb2.RateLimitDescriptor.Entry(key=k, value=v) for k, v in entries
                ]
            )
        ],
    )


def test_the_descriptor_carries_the_estimates_parts() -> None:
    parts = ((wire.META_TOKEN_PROMPT, "200"), (wire.META_TOKEN_CHOICES, "3"))
    parsed = parse(tokens_request("a", 800, *parts)).admission
    assert parsed is not None and parsed.grant == Grant(200, 3)
    for partial in (
        (),
        parts[:1],
        ((wire.META_TOKEN_PROMPT, "200"), (wire.META_TOKEN_CHOICES, "0")),
    ):
        admission = parse(tokens_request("a", 800, *partial)).admission
        assert admission is not None and admission.grant is None  # the budget refuses as before


async def test_the_lowered_cap_reaches_envoy_as_rate_limit_metadata(resp: Resp) -> None:
    """What envoy/rewrite.lua reads: the cap in the RLS response's dynamic metadata (Envoy keeps
    it under the rate-limit filter's name), only when the budget lowered it."""
    engine = limiter(resp)
    parts = ((wire.META_TOKEN_PROMPT, "100"), (wire.META_TOKEN_CHOICES, "2"))
    answers = []
    for rid in ("a", "b"):
        parsed = parse(tokens_request(rid, 700, *parts))
        assert parsed.admission is not None
        answers.append(to_response(parsed, await engine.admit(parsed.admission)))
    whole, lowered = answers
    assert whole.overall_code == lowered.overall_code == rls_pb2.RateLimitResponse.Code.OK
    assert wire.META_OUTPUT_CAP not in whole.dynamic_metadata.fields
    assert (
        lowered.dynamic_metadata.fields[wire.META_OUTPUT_CAP].number_value == 100
    )  # (300 − 100) / 2
