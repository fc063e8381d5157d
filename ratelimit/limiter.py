"""The decision: resolve a tenant's limits, run one atomic store call, fold the result.

Independent of gRPC and of Redis: the store, the fleet signal, the clock and the jitter source
are injected, so every rule is testable with a simulated clock and in-process counters.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from decimal import ROUND_CEILING, Decimal
from typing import Literal

from llmgw.fleetload import FleetLoad
from llmgw.prices import Prices
from llmgw.tiers import TenantSpec
from llmgw.wire import breaker_key, tenant_prefix
from ratelimit import metrics
from ratelimit.fleet import effective_load
from ratelimit.pool import Draw, Pool, size
from ratelimit.store import Store
from ratelimit.types import (
    MAX_COUNT,
    PRICE_SCALE,
    Admission,
    Check,
    CheckState,
    Grant,
    Kind,
    KindState,
    Period,
    Policy,
    Refusal,
    StoreResult,
    Unit,
    Verdict,
    granted,
    share,
)
from ratelimit.windows import SLIDING, fixed, period, state

RETRY_MIN_MS = 1_000
RETRY_MAX_MS = 30_000
MAX_PLANS = 1024
# A tenant's policy: its tier's limits with its own merged over them (ratelimit/limits.py), from
# (tenant, tier, its own requests limit, its own tokens limit) as the request carries them.
Resolve = Callable[[str, str, TenantSpec | None], Policy]


def retry_after_ms(base_s: float, load: float, free_ms: int, jitter: float) -> int:
    """base × min(3, load/0.7) × jitter, clamped to [1, 30] s, never before the window frees."""
    formula = base_s * min(3.0, load / 0.7) * jitter * 1000
    return max(int(min(max(formula, RETRY_MIN_MS), RETRY_MAX_MS)), free_ms)


class Limiter:
    def __init__(
        self,
        limits: Resolve,
        store: Store,
        fleet: Callable[[], FleetLoad],
        clock: Callable[[], float],
        *,
        reservation_ttl_s: float = 300.0,
        stale_after_s: float = 3.0,
        near_limit_ratio: float = 0.1,
        rng: random.Random | None = None,
        pool: Pool | None = None,
    ) -> None:
        self.limits = limits
        self.store = store
        self.fleet = fleet
        self.pool = pool  # None: nobody borrows
        self.clock = clock
        self.reservation_ttl_ms = int(reservation_ttl_s * 1000)
        self.stale_after_s = stale_after_s
        self.near_limit_ratio = near_limit_ratio
        self.rng = rng or random.Random()
        # Per policy object (the limits config hands out the same one while it is current): its
        # request checks, which never change, and its reserving checks at cost 0 as templates,
        # so a decision builds only the checks its estimate costs. Keeping the policy makes the
        # id() key safe (a live object's id is not reused).
        self._plans: dict[int, tuple[Policy, tuple[Check, ...], tuple[Check, ...]]] = {}

    @staticmethod
    def checks(
        policy: Policy, estimate: int | None, count_request: bool = True, money: int = 0
    ) -> list[Check]:
        """The checks of one admission, at the base limits (`money`: its worst-case cost in
        micro-units, for the money budgets)."""
        checks: list[Check] = []
        kinds: list[tuple[Kind, int, bool]] = [("requests", 1, False)] if count_request else []
        if estimate is not None:
            kinds.append(("tokens", estimate, True))
        for kind, cost, reserve in kinds:
            for lim in policy.requests if kind == "requests" else policy.tokens:
                checks.append(
                    Check(f"{kind}:{lim.unit}", SLIDING[lim.unit], lim.amount, cost, reserve)
                )
        if estimate is not None and policy.budget is not None:
            unit = policy.budget.unit
            checks.append(
                Check(f"budget:{unit}", fixed(unit), policy.budget.amount, estimate, True, True)
            )
        if estimate is not None:
            for per, amount in policy.spend:
                checks.append(Check(f"spend:{per}", period(per), amount, money, True, True, True))
        return checks

    def _checks(
        self, policy: Policy, estimate: int | None, money: int, count_request: bool
    ) -> list[Check]:
        """`checks`, from the policy's cached plan."""
        plan = self._plans.get(id(policy))
        if plan is None or plan[0] is not policy:
            if len(self._plans) >= MAX_PLANS:  # each new table makes new policies
                self._plans.clear()
            base = self.checks(policy, 0)
            requests = tuple(c for c in base if not c.reserve)
            plan = self._plans[id(policy)] = (policy, requests, tuple(c for c in base if c.reserve))
        checks = list(plan[1]) if count_request else []
        if estimate is not None:
            checks += [
                Check(
                    c.name, c.window, c.limit, money if c.money else estimate, True, c.caps, c.money
                )
                for c in plan[2]
            ]
        return checks

    async def admit(self, req: Admission) -> Verdict:
        policy = self.limits(req.tenant, req.tier, req.own)
        now_s = self.clock()
        now_ms = int(now_s * 1000)
        fleet = self.fleet()
        load = effective_load(fleet, now_s, self.stale_after_s)
        estimate, fitted = self._fitted(policy, fleet, req.token_estimate, req.grant)
        money, priced = _priced(policy, req, estimate)
        checks = self._checks(policy, estimate, money, req.count_request)
        states: list[CheckState] = []
        draws: tuple[Draw, ...] = ()
        cap = 0
        if checks:
            prefix = tenant_prefix(req.tenant)
            reservation = (req.request_id or "") if req.token_estimate is not None else ""
            # Only a budget that binds lowers the cap, and never in shadow mode (it would act).
            budgets = policy.budget is not None or policy.spend
            grant = priced if budgets and not policy.shadow else None
            outcome = await self.store.admit(
                prefix,
                checks,
                now_ms,
                shadow=policy.shadow,
                reservation=reservation,
                ttl_ms=self.reservation_ttl_ms,
                grant=grant,
                breaker=breaker_key(req.tenant),
            )
            if outcome.circuit_ms is not None:
                return self._circuit_open(req, policy, outcome.circuit_ms)
            cap = outcome.cap or fitted
            states = _states(granted(checks, grant, outcome.cap), outcome, policy.shadow)
            if outcome.local:
                metrics.degraded_decisions(req.tenant, policy.tier).inc()
            elif not outcome.admitted and self._may_borrow(policy, states):
                borrowed = await self._borrow(
                    prefix, reservation, grant, policy, fleet, load, states, now_ms
                )
                if borrowed is not None:
                    states, draws, cap = borrowed[0], borrowed[1], borrowed[2] or cap
        refusal, refused = self._refusal(states, checks, policy, fleet)
        retry_ms = 0
        if refused is not None and refusal in ("requests", "tokens"):
            free_ms = max(s.free_ms for s in states if not s.passed)
            retry_ms = retry_after_ms(
                policy.retry_base_s, load, free_ms, self.rng.uniform(0.8, 1.2)
            )
        borrowed_requests = borrowed_tokens = 0
        if draws:
            borrowed_requests = max((d.amount for d in draws if d.kind == "requests"), default=0)
            borrowed_tokens = max((d.amount for d in draws if d.kind == "tokens"), default=0)
        self._count(req, policy, states, refusal, borrowed_requests, borrowed_tokens)
        if cap and refusal is None:
            metrics.capped(req.tenant, policy.tier).inc()
        return Verdict(
            tenant=req.tenant,
            tier=policy.tier,
            refusal=None if policy.shadow else refusal,
            refused=refused,
            requests=_headline("requests", checks, states),
            tokens=_headline("tokens", checks, states),
            retry_after_ms=retry_ms,
            shadow=policy.shadow,
            borrowed_requests=borrowed_requests,
            borrowed_tokens=borrowed_tokens,
            output_cap=cap if refusal is None else 0,
        )

    @staticmethod
    def _circuit_open(req: Admission, policy: Policy, wait_ms: int) -> Verdict:
        """Refused by the tenant's breaker (never in shadow mode: admit.lua skips it there)."""
        metrics.decisions(req.tenant, policy.tier, "circuit_open", "false").inc()
        return Verdict(
            tenant=req.tenant,
            tier=policy.tier,
            refusal="circuit_open",
            refused=None,
            requests=None,
            tokens=None,
            retry_after_ms=wait_ms,
            shadow=False,
        )

    def _may_borrow(self, policy: Policy, states: list[CheckState]) -> bool:
        """A refusal on rate limits only (hard budgets never borrow), of a tier that borrows."""
        if self.pool is None or policy.borrow_share <= 0 or policy.shadow:
            return False
        return all(s.passed or s.check.name in _RATES for s in states)

    async def _borrow(
        self,
        prefix: str,
        reservation: str,
        grant: Grant | None,
        policy: Policy,
        fleet: FleetLoad,
        load: float,
        refused: list[CheckState],
        now_ms: int,
    ) -> tuple[list[CheckState], tuple[Draw, ...], int] | None:
        """The refused admission again on borrowed quota (steps 2 and 3 of ratelimit/pool.py),
        and the cap the budget lowered it to there (0: none further); None when the pool or the
        second admission says no."""
        assert self.pool is not None
        wants = []
        for s in refused:
            if not s.passed:
                kind, unit = _RATES[s.check.name]
                excess = s.used + s.check.cost - max(s.check.limit, s.used)
                wants.append(Draw(kind, unit, excess))
        draws = await self.pool.draw(fleet, load, policy.borrow_share, wants)
        if draws is None:
            return None
        raised = [s.check if s.passed else _raised(s) for s in refused]
        outcome = await self.store.admit(
            prefix,
            raised,
            now_ms,
            reservation=reservation,
            ttl_ms=self.reservation_ttl_ms,
            grant=grant,
        )
        if not outcome.admitted or outcome.local:
            await self.pool.give_back(draws)
            return None
        return _states(granted(raised, grant, outcome.cap), outcome, False), draws, outcome.cap

    def _fitted(
        self, policy: Policy, fleet: FleetLoad, estimate: int | None, grant: Grant | None
    ) -> tuple[int | None, int]:
        """(estimate, cap): an estimate above the highest a token window could ever hold, lowered
        to fit it when the prompt and one token a sequence do, with the cap that makes it fit
        (0: unchanged). extauthz's cap can exceed it while a reload of the tier table reaches
        extauthz later than this service: that request is served shorter, not "too large"."""
        if estimate is None or grant is None or policy.shadow:
            return estimate, 0
        windows = [c for c in self.checks(policy, estimate, False) if c.name.startswith("tokens:")]
        ceiling = min(self._ceilings(windows, policy, fleet), default=estimate)
        cap = grant.cap(ceiling)
        if estimate <= ceiling or cap < 1:
            return estimate, 0
        return grant.cost(cap), cap

    def _ceilings(self, checks: list[Check], policy: Policy, fleet: FleetLoad) -> list[int]:
        """The highest limit each check could ever have: its base plus, for a tier that borrows,
        its share of the whole pool the fleet's measured capacity makes (at load 0)."""
        if self.pool is None or policy.borrow_share <= 0:
            return [c.limit for c in checks]
        out = []
        for c in checks:
            rate = _RATES.get(c.name)
            extra = 0 if rate is None else size(fleet, 0.0, *rate)
            out.append(c.limit + int(extra * policy.borrow_share))
        return out

    def _refusal(
        self, states: list[CheckState], checks: list[Check], policy: Policy, fleet: FleetLoad
    ) -> tuple[Refusal | None, KindState | None]:
        """What refused, judged against the ceilings of the base `checks` (computed only for a
        refusal on rate limits, not on every decision)."""
        failed = [s for s in states if not s.passed]
        if not failed:
            return None, None
        budget = [s for s in failed if s.check.name not in _RATES]
        if budget:
            return "insufficient_quota", _kind_state(budget[0])
        # A cost above every limit the window could ever have: waiting cannot help.
        ceilings = self._ceilings(checks, policy, fleet)
        for s, ceiling in zip(states, ceilings, strict=True):
            if not s.passed and s.check.cost > ceiling:
                return "too_large", replace(_kind_state(s), limit=ceiling)
        requests = [s for s in failed if s.check.name.startswith("requests:")]
        first = (requests or failed)[0]
        return ("requests" if requests else "tokens"), _kind_state(first)

    def _count(
        self,
        req: Admission,
        policy: Policy,
        states: list[CheckState],
        refusal: Refusal | None,
        borrowed_requests: int,
        borrowed_tokens: int,
    ) -> None:
        tenant, tier = req.tenant, policy.tier
        shadow = "true" if policy.shadow else "false"
        metrics.decisions(tenant, tier, refusal or "ok", shadow).inc()
        added = refusal is None or policy.shadow
        for s in states:
            kind = _NAMES[s.check.name][0]
            if not s.passed:
                metrics.over_limit(tenant, tier, kind).inc()
            elif added and s.check.limit - s.used < self.near_limit_ratio * s.check.limit:
                metrics.near_limit(tenant, tier, kind).inc()
        for kind, amount in (("requests", borrowed_requests), ("tokens", borrowed_tokens)):
            if amount:
                metrics.borrowed(tenant, tier, kind).inc(amount)


# Check name → its kind and unit ("budget:day" is a token limit), without parsing per decision:
# the rate limits (which may borrow), and every check.
_RATES: dict[str, tuple[Literal["requests", "tokens"], Unit]] = {
    f"{kind}:{unit.value}": (kind, unit) for kind in ("requests", "tokens") for unit in Unit
}
_NAMES: dict[str, tuple[Kind, Unit | Period]] = {
    **_RATES,
    **{f"budget:{unit.value}": ("tokens", unit) for unit in Unit},
    **{f"spend:{per.value}": ("spend", per) for per in Period},
}


def _priced(policy: Policy, req: Admission, estimate: int | None) -> tuple[int, Grant | None]:
    """The worst-case cost in micro-units of a request of `estimate` tokens, for the money
    budgets, and the grant with its money parts (types.Grant): the prompt at its ceiling and
    every output token at the model's prices (a model not named: the table's dearest), rounded
    up. (0, req.grant) for a tenant without a money budget."""
    grant = req.grant
    if not policy.spend or estimate is None or policy.prices is None:
        return 0, grant
    inp, out = _prices(policy, req.model)
    if grant is None:
        return -(-estimate * max(inp, out) // PRICE_SCALE), None
    cap = max(0, estimate - grant.prompt) // grant.sequences
    ceiling = max(req.prompt_ceiling, grant.prompt)
    grant = replace(
        grant,
        base=-(-ceiling * inp // PRICE_SCALE),
        per_cap=grant.sequences * out,
    )
    return grant.base + -(-cap * grant.sequences * out // PRICE_SCALE), grant


def _prices(policy: Policy, model: str | None) -> tuple[int, int]:
    """A prompt token's and an output token's worst-case price, in millionths of a micro-unit
    (rounded up); (0, 0) for a model without a price. Kept per table and model (a table is
    immutable; keeping it makes the id() key safe)."""
    assert policy.prices is not None
    table = policy.prices
    key = (id(table), model)
    found = _SCALED.get(key)
    if found is None or found[0] is not table:
        if len(_SCALED) >= MAX_PLANS:  # models named by callers, tables made by reloads
            _SCALED.clear()
        found = _SCALED[key] = (table, *_worst(table, model))
    return found[1], found[2]


_SCALED: dict[tuple[int, str | None], tuple[Prices, int, int]] = {}


def _worst(table: Prices, model: str | None) -> tuple[int, int]:
    if model is not None:
        found = table.of(model)
        listed = [found] if found is not None else []
    else:
        listed = [*table.models.values(), *([table.default] if table.default else [])]
    inp = max((max(p.input, p.cached_input or p.input) for p in listed), default=Decimal(0))
    out = max((p.output for p in listed), default=Decimal(0))
    return _scaled(inp), _scaled(out)


def _scaled(price: Decimal) -> int:
    return int((price * PRICE_SCALE).to_integral_value(ROUND_CEILING))


def _raised(s: CheckState) -> Check:
    """A refused check's limit for the admission on borrowed quota: the base limit plus the draw
    when part of the cost fits under it; no bound when all of it was drawn (ratelimit/pool.py)."""
    if s.used < s.check.limit:
        return replace(s.check, limit=s.used + s.check.cost)
    return replace(s.check, limit=MAX_COUNT)


def _states(checks: list[Check], outcome: StoreResult, shadow: bool) -> list[CheckState]:
    """Each check's standing after the store's decision, at the limit the store enforced (one
    replica's share when degraded) and the time it decided at."""
    added = outcome.admitted or shadow
    r = outcome.replicas
    return [
        state(
            check if r == 1 else replace(check, limit=share(check.limit, r)),
            c,
            added,
            outcome.now_ms,
        )
        for check, c in zip(checks, outcome.counts, strict=True)
    ]


def _headline(kind: Kind, base: list[Check], states: list[CheckState]) -> KindState | None:
    """What the x-ratelimit-*-{kind} headers report: the per-minute limit (OpenAI's RPM and TPM)
    at its base amount, without what was borrowed; else the kind's limit closest to exhaustion.
    Hard budgets only when the kind has no other limit."""
    rate: list[tuple[Check, CheckState]] = []
    budget: list[tuple[Check, CheckState]] = []
    for c, s in zip(base, states, strict=True):
        if _NAMES[c.name][0] == kind:
            (budget if c.name.startswith("budget:") else rate).append((c, s))
    pairs = rate or budget
    if not pairs:
        return None
    minute = next((p for p in pairs if _NAMES[p[0].name][1] is Unit.MINUTE), None)
    check, s = minute or min(pairs, key=lambda p: (p[1].passed, _room(p[0], p[1])))
    limit = min(check.limit, s.check.limit)  # a degraded replica enforces only its share
    own_kind, unit = _NAMES[s.check.name]
    return KindState(
        kind=own_kind,
        limit=limit,
        unit=unit,
        remaining=max(0, limit - s.used),
        reset_ms=s.reset_ms,
        used=s.used,
        requested=s.check.cost,
    )


def _room(check: Check, s: CheckState) -> float:
    return (check.limit - s.used) / max(check.limit, 1)


def _kind_state(s: CheckState) -> KindState:
    kind, unit = _NAMES[s.check.name]
    return KindState(
        kind=kind,
        limit=s.check.limit,
        unit=unit,
        remaining=max(0, s.check.limit - s.used),
        reset_ms=s.reset_ms,
        used=s.used,
        requested=s.check.cost,
    )
