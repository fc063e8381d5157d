"""The decision: resolve a tenant's limits, run one atomic store call, fold the result.

Independent of gRPC and of Redis: the store, the fleet signal, the clock and the jitter source
are injected, so every rule is testable with a simulated clock and in-process counters.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace

from llmgw.wire import tenant_prefix
from ratelimit import metrics
from ratelimit.fleet import FleetLoad, borrowable, effective_load
from ratelimit.store import Store
from ratelimit.types import (
    UNIT_MS,
    Admission,
    Check,
    CheckState,
    Kind,
    KindState,
    Limit,
    Policy,
    Refusal,
    Unit,
    Verdict,
)
from ratelimit.windows import SLIDING, fixed, state

RETRY_MIN_MS = 1_000
RETRY_MAX_MS = 30_000


def overridden(policy: Policy, requests: Limit | None, tokens: Limit | None) -> Policy:
    """The policy with a tenant's own limits, each replacing the limit of its unit."""
    if requests is None and tokens is None:
        return policy

    def merge(limits: tuple[Limit, ...], own: Limit | None) -> tuple[Limit, ...]:
        if own is None:
            return limits
        return tuple(sorted((*(x for x in limits if x.unit != own.unit), own), key=_unit_ms))

    return replace(
        policy, requests=merge(policy.requests, requests), tokens=merge(policy.tokens, tokens)
    )


def _unit_ms(limit: Limit) -> int:
    return UNIT_MS[limit.unit]


def retry_after_ms(base_s: float, load: float, free_ms: int, jitter: float) -> int:
    """base × min(3, load/0.7) × jitter, clamped to [1, 30] s, never before the window frees."""
    formula = base_s * min(3.0, load / 0.7) * jitter * 1000
    return max(int(min(max(formula, RETRY_MIN_MS), RETRY_MAX_MS)), free_ms)


class Limiter:
    def __init__(
        self,
        limits: Callable[[str, str], Policy],
        store: Store,
        fleet: Callable[[], FleetLoad],
        clock: Callable[[], float],
        *,
        reservation_ttl_s: float = 300.0,
        stale_after_s: float = 3.0,
        near_limit_ratio: float = 0.1,
        rng: random.Random | None = None,
    ) -> None:
        self.limits = limits
        self.store = store
        self.fleet = fleet
        self.clock = clock
        self.reservation_ttl_ms = int(reservation_ttl_s * 1000)
        self.stale_after_s = stale_after_s
        self.near_limit_ratio = near_limit_ratio
        self.rng = rng or random.Random()

    def checks(
        self,
        policy: Policy,
        estimate: int | None,
        fleet: FleetLoad,
        now_s: float,
        count_request: bool = True,
    ) -> tuple[list[Check], list[tuple[Kind, int]]]:
        """The checks of one admission, and each one's kind and base limit (before borrowing)."""
        checks: list[Check] = []
        bases: list[tuple[Kind, int]] = []
        kinds: list[tuple[Kind, int, bool]] = [("requests", 1, False)] if count_request else []
        if estimate is not None:
            kinds.append(("tokens", estimate, True))
        for kind, cost, reserve in kinds:
            for lim in policy.requests if kind == "requests" else policy.tokens:
                extra = borrowable(
                    fleet, kind, lim.unit, policy.borrow_share, now_s, self.stale_after_s
                )
                checks.append(
                    Check(
                        f"{kind}:{lim.unit}", SLIDING[lim.unit], lim.amount + extra, cost, reserve
                    )
                )
                bases.append((kind, lim.amount))
        if estimate is not None and policy.budget is not None:
            unit = policy.budget.unit
            checks.append(
                Check(f"budget:{unit}", fixed(unit), policy.budget.amount, estimate, True)
            )
            bases.append(("tokens", policy.budget.amount))
        return checks, bases

    async def admit(self, req: Admission) -> Verdict:
        policy = overridden(self.limits(req.tenant, req.tier), req.requests_limit, req.tokens_limit)
        now_s = self.clock()
        now_ms = int(now_s * 1000)
        fleet = self.fleet()
        checks, bases = self.checks(policy, req.token_estimate, fleet, now_s, req.count_request)
        states: list[CheckState] = []
        if checks:
            reservation = (req.request_id or "") if req.token_estimate is not None else ""
            outcome = await self.store.admit(
                tenant_prefix(req.tenant),
                checks,
                now_ms,
                shadow=policy.shadow,
                reservation=reservation,
                ttl_ms=self.reservation_ttl_ms,
            )
            added = outcome.admitted or policy.shadow
            share = outcome.share
            for check, counts in zip(checks, outcome.counts, strict=True):
                enforced = check if share == 1 else replace(check, limit=int(check.limit * share))
                states.append(state(enforced, counts, added, now_ms))
            if outcome.local:
                metrics.degraded_decisions(req.tenant, policy.tier).inc()
        refusal, refused = self._refusal(states)
        retry_ms = 0
        if refused is not None and refusal != "insufficient_quota":
            free_ms = max(s.free_ms for s in states if not s.passed)
            load = effective_load(fleet, now_s, self.stale_after_s)
            retry_ms = retry_after_ms(
                policy.retry_base_s, load, free_ms, self.rng.uniform(0.8, 1.2)
            )
        self._count(req, policy, states, bases, refusal)
        return Verdict(
            tenant=req.tenant,
            tier=policy.tier,
            refusal=None if policy.shadow else refusal,
            refused=refused,
            requests=self._binding("requests", states),
            tokens=self._binding("tokens", states),
            retry_after_ms=retry_ms,
            shadow=policy.shadow,
        )

    @staticmethod
    def _refusal(states: list[CheckState]) -> tuple[Refusal | None, KindState | None]:
        failed = [s for s in states if not s.passed]
        if not failed:
            return None, None
        budget = [s for s in failed if s.check.name.startswith("budget:")]
        requests = [s for s in failed if s.check.name.startswith("requests:")]
        first = (budget or requests or failed)[0]
        refusal: Refusal = "insufficient_quota" if budget else "requests" if requests else "tokens"
        return refusal, _kind_state(first)

    @staticmethod
    def _binding(kind: Kind, states: list[CheckState]) -> KindState | None:
        """The limit of a kind that is closest to exhaustion (a refusing one first)."""
        best: CheckState | None = None
        best_key = (True, 0.0)
        prefix = kind + ":"
        for s in states:
            if not s.check.name.startswith(prefix):
                continue
            limit = s.check.limit
            key = (s.passed, (limit - s.used) / max(limit, 1))
            if best is None or key < best_key:  # the first of equals, as min() picks
                best, best_key = s, key
        return None if best is None else _kind_state(best)

    def _count(
        self,
        req: Admission,
        policy: Policy,
        states: list[CheckState],
        bases: list[tuple[Kind, int]],
        refusal: Refusal | None,
    ) -> None:
        tenant, tier = req.tenant, policy.tier
        shadow = "true" if policy.shadow else "false"
        metrics.decisions(tenant, tier, refusal or "ok", shadow).inc()
        added = refusal is None or policy.shadow
        for s, (kind, base) in zip(states, bases, strict=True):
            if not s.passed:
                metrics.over_limit(tenant, tier, kind).inc()
            elif added:
                if s.check.limit - s.used < self.near_limit_ratio * s.check.limit:
                    metrics.near_limit(tenant, tier, kind).inc()
                borrowed = min(s.check.cost, s.used - base)
                if borrowed > 0:
                    metrics.borrowed(tenant, tier, kind).inc(borrowed)


# Check name → its kind and unit ("budget:day" is a token limit), without parsing per decision.
_NAMES: dict[str, tuple[Kind, Unit]] = {
    f"{role}:{unit.value}": ("requests" if role == "requests" else "tokens", unit)
    for role in ("requests", "tokens", "budget")
    for unit in Unit
}


def _kind_state(s: CheckState) -> KindState:
    name = s.check.name
    known = _NAMES.get(name)
    if known is None:
        kind: Kind = "requests" if name.startswith("requests:") else "tokens"
        known = (kind, Unit(name.split(":", 1)[1]))
    return KindState(
        kind=known[0],
        limit=s.check.limit,
        unit=known[1],
        remaining=max(0, s.check.limit - s.used),
        reset_ms=s.reset_ms,
        used=s.used,
        requested=s.check.cost,
    )
