"""Per-tenant limits from the tenants file, carried in Envoy's descriptor `limit` override."""

from __future__ import annotations

from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2

from llmgw.tiers import PerUnit, TenantSpec
from ratelimit.descriptors import parse
from ratelimit.types import Admission
from tests.ratelimit.test_rl_limiter import NOW, Env, tier

Override = ratelimit_pb2.RateLimitDescriptor.RateLimitOverride
RateLimit = rls_pb2.RateLimitResponse.RateLimit


def entries(*pairs: tuple[str, str]) -> list[ratelimit_pb2.RateLimitDescriptor.Entry]:
    return [ratelimit_pb2.RateLimitDescriptor.Entry(key=k, value=v) for k, v in pairs]


def test_descriptor_limits_become_the_admissions_own_limits() -> None:
    who = (("tenant", "acme"), ("tier", "standard"))
    request = rls_pb2.RateLimitRequest(
        domain="llmgw",
        descriptors=[
            ratelimit_pb2.RateLimitDescriptor(
                entries=entries(("kind", "requests"), *who),
                limit=Override(requests_per_unit=7, unit=RateLimit.MINUTE),
            ),
            ratelimit_pb2.RateLimitDescriptor(
                entries=entries(
                    ("kind", "tokens"), *who, ("request_id", "r"), ("token_estimate", "9")
                ),
                limit=Override(requests_per_unit=900, unit=RateLimit.MINUTE),
            ),
        ],
    )
    admission = parse(request).admission
    assert admission is not None
    assert admission.own == TenantSpec(requests=PerUnit(minute=7), tokens=PerUnit(minute=900))


def test_no_override_leaves_the_tiers_limits() -> None:
    request = rls_pb2.RateLimitRequest(
        domain="llmgw",
        descriptors=[
            ratelimit_pb2.RateLimitDescriptor(
                entries=entries(("kind", "requests"), ("tenant", "a"))
            )
        ],
    )
    admission = parse(request).admission
    assert admission is not None and admission.own is None


async def test_a_tenants_own_limit_replaces_the_tiers_limit_of_that_unit() -> None:
    env = Env(tier(requests=PerUnit(second=100, minute=1000), tokens=PerUnit(minute=10_000)))
    own = TenantSpec(requests=PerUnit(minute=3))
    ok = [(await env.limiter.admit(Admission("acme", "t", own=own))).allowed for _ in range(5)]
    assert ok == [True, True, True, False, False]
    verdict = await env.limiter.admit(Admission("acme", "t", own=own))
    assert verdict.requests is not None and verdict.requests.limit == 3
    # The per-second limit of the tier still applies beside it.
    env.now = NOW + 120
    verdicts = [await env.limiter.admit(Admission("other", "t")) for _ in range(101)]
    assert sum(v.allowed for v in verdicts) == 100
    # The headers report the per-minute limit (OpenAI's RPM), not the per-second one.
    assert verdicts[0].requests is not None and verdicts[0].requests.limit == 1000
