"""Tenant priority → vLLM's `priority`: the one mapping the gateway sends and the docs show.

A tenant's priority is 1–10, higher is more important (the tenants file). vLLM's is an integer,
default 0, lower is served earlier (`--scheduling-policy priority`: a heap on (priority, arrival);
the preempted request is the running one with the largest). extauthz sends the mapped value as
`x-vllm-priority` on every request (vLLM 0.33 lets that header override the body's field), so a
client's own `priority` never decides. README.md's table is this function, checked by a test.
"""

from __future__ import annotations

TENANT_MIN = 1
TENANT_MAX = 10
NEUTRAL = 0  # vLLM's default: what every request gets when tenant priority is switched off


def vllm_priority(tenant_priority: int) -> int:
    """10 → 0 (served first) … 1 → 9 (served last); never below vLLM's default of 0."""
    if not TENANT_MIN <= tenant_priority <= TENANT_MAX:
        raise ValueError(f"tenant priority {tenant_priority} is outside {TENANT_MIN}–{TENANT_MAX}")
    return TENANT_MAX - tenant_priority
