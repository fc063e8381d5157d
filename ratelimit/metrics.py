"""Prometheus collectors of the rate limiter (labels: tenant, tier), served by the process that
holds it: extauthz, or `python -m ratelimit`. Tenants past the process's first
`metrics.tenant_labels` are `other` (llmgw/telemetry.py TENANTS)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from llmgw.telemetry import TENANTS, Children

DECISIONS = Counter(
    "llmgw_ratelimit_decisions_total",
    "Admission decisions by result (ok, requests, tokens, insufficient_quota) and shadow mode.",
    ["tenant", "tier", "result", "shadow"],
)
OVER_LIMIT = Counter(
    "llmgw_ratelimit_over_limit_total",
    "Checks over their limit (also counted in shadow mode), by kind.",
    ["tenant", "tier", "kind"],
)
NEAR_LIMIT = Counter(
    "llmgw_ratelimit_near_limit_total",
    "Admitted decisions that left less than the near-limit ratio of a limit, by kind.",
    ["tenant", "tier", "kind"],
)
BORROWED = Counter(
    "llmgw_ratelimit_borrowed_total",
    "Requests or tokens admitted beyond the base limit from the fleet's idle capacity.",
    ["tenant", "tier", "kind"],
)
CAPPED = Counter(
    "llmgw_ratelimit_budget_capped_total",
    "Requests admitted at an output cap lowered to what the tenant's hard budget had left.",
    ["tenant", "tier"],
)
DEGRADED = Gauge(
    "llmgw_ratelimit_degraded", "1 while decisions are answered from in-process counters."
)
DEGRADED_DECISIONS = Counter(
    "llmgw_ratelimit_degraded_decisions_total",
    "Decisions answered from in-process counters (Redis slow or down).",
    ["tenant", "tier"],
)
REDIS_SECONDS = Histogram(
    "llmgw_ratelimit_redis_seconds",
    "Redis script round trip.",
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05),
)
DECISION_SECONDS = Histogram(
    "llmgw_ratelimit_decision_seconds",
    "Time to decide one RateLimitRequest inside the service.",
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05),
)


# The children the decision path increments, looked up once per label tuple.
decisions = Children(DECISIONS, tenant=TENANTS.admit)
over_limit = Children(OVER_LIMIT, tenant=TENANTS.admit)
near_limit = Children(NEAR_LIMIT, tenant=TENANTS.admit)
borrowed = Children(BORROWED, tenant=TENANTS.admit)
capped = Children(CAPPED, tenant=TENANTS.admit)
degraded_decisions = Children(DEGRADED_DECISIONS, tenant=TENANTS.admit)
