"""Answers that make the OpenAI SDK do the right thing: a request that can never fit is "Request
too large" (never retried), and the x-ratelimit-* headers report the per-minute base quota."""

from __future__ import annotations

import json
import time

from llmgw.fleetload import FleetLoad
from llmgw.resp import Resp
from llmgw.tiers import PerUnit, TierSpec, TierTable
from ratelimit.limiter import Limiter
from ratelimit.limits import Limits
from ratelimit.pool import Pool
from ratelimit.redis_store import RedisStore
from ratelimit.response import rate_headers, refusal
from ratelimit.types import Admission, Grant
from tests.ratelimit.test_rl_limiter import Env, tier

TABLE = TierTable(
    tiers={
        "lender": TierSpec(
            requests=PerUnit(second=50, minute=10),
            tokens=PerUnit(minute=1000),
            borrow_share=0.5,
        )
    }
)


# Tokens pool per minute at load 0.2: 10 000 × (0.7 − 0.2) × 0.8 = 4000; at load 0: 5600, of which
# a borrow share of 0.5 may ever take 2800.
def idle() -> FleetLoad:
    return FleetLoad(load=0.2, capacity_tpm=10_000, capacity_rpm=1000, ts=time.time())


def borrowing(resp: Resp) -> Limiter:
    return Limiter(
        Limits(TABLE).policy,
        RedisStore(resp),
        idle,
        time.time,
        pool=Pool(lambda: resp, deadline_s=2.0),
    )


async def test_a_request_above_its_limit_is_too_large_and_never_retried() -> None:
    env = Env(tier(tokens=PerUnit(minute=1000)))
    verdict = await env.limiter.admit(Admission("acme", "t", token_estimate=1001))
    assert verdict.refusal == "too_large"
    assert verdict.refused is not None and verdict.refused.limit == 1000
    assert verdict.retry_after_ms == 0
    headers, body = refusal(verdict)
    assert ("x-should-retry", "false") in headers
    assert not any(name.startswith("retry-after") for name, _ in headers)
    error = json.loads(body)["error"]
    assert error["message"].startswith("Request too large for tenant acme on tokens per minute")
    assert "Limit 1000, Requested 1001" in error["message"]
    assert (error["type"], error["code"]) == ("tokens", "rate_limit_exceeded")
    # One that fits an empty window is an ordinary rate limit once the window is full.
    assert (await env.limiter.admit(Admission("acme", "t", token_estimate=1000))).allowed
    later = await env.limiter.admit(Admission("acme", "t", token_estimate=1000))
    assert later.refusal == "tokens" and later.retry_after_ms > 0


async def test_too_large_counts_what_borrowing_could_ever_add(resp: Resp) -> None:
    limiter = borrowing(resp)
    # Above the base of 1000 but within what the pool could ever lend: borrowed now.
    fits = await limiter.admit(Admission("a", "lender", token_estimate=2500))
    assert fits.allowed and fits.borrowed_tokens > 0
    # Above base + 0.5 × the whole pool at load 0 (1000 + 2800): never.
    never = await limiter.admit(Admission("b", "lender", token_estimate=3801))
    assert never.refusal == "too_large"
    assert never.refused is not None and never.refused.limit == 3800


async def test_headers_report_the_per_minute_base_quota_not_the_borrowed_extra(
    resp: Resp,
) -> None:
    limiter = borrowing(resp)
    verdicts = [await limiter.admit(Admission("c", "lender", token_estimate=10)) for _ in range(12)]
    assert all(v.allowed for v in verdicts)
    assert verdicts[-1].borrowed_requests > 0  # 12 admitted under a base of 10
    headers = dict(rate_headers(verdicts[-1]))
    assert headers["x-ratelimit-limit-requests"] == "10"  # the minute's, not the second's 50
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-limit-tokens"] == "1000"


async def test_a_cap_above_every_limit_is_lowered_to_fit_not_refused() -> None:
    """extauthz's cap can exceed a token limit while a shrunk tier table has reached this
    service and not yet extauthz: the request is served at the cap that fits. Only a prompt
    that cannot fit with one token a sequence is too large."""
    env = Env(tier(tokens=PerUnit(minute=3000)))
    fits = await env.limiter.admit(
        Admission("acme", "t", token_estimate=97 + 4096, grant=Grant(97, 1))
    )
    assert fits.allowed and fits.output_cap == 3000 - 97
    assert fits.tokens is not None and fits.tokens.used == 3000
    never = await env.limiter.admit(
        Admission("other", "t", token_estimate=3000 + 2 * 4096, grant=Grant(3000, 2))
    )
    assert never.refusal == "too_large"
