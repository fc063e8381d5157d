"""A tenant's limits, resolved from the tier table (llmgw/tiers.py) into a Policy."""

from __future__ import annotations

import logging
from collections.abc import Callable

from llmgw.prices import MICROS
from llmgw.tiers import PerUnit, TenantSpec, TierTable
from ratelimit.types import Limit, Policy

log = logging.getLogger(__name__)


def _limits(per: PerUnit) -> tuple[Limit, ...]:
    return tuple(Limit(unit, amount) for unit, amount in per.amounts())


def kept(table: TierTable, previous: Limits | None) -> Limits:
    """The Limits of a new tier table. A tier the previous table had and this one lacks is kept
    until a restart: tenants may still name it (extauthz refuses a tenants file naming a missing
    tier and keeps its last good one), and dropping it would put them on the default tier's
    limits."""
    if previous is not None:
        gone = {n: s for n, s in previous.config.tiers.items() if n not in table.all_tiers}
        if gone:
            log.warning(
                "tiers removed from the tier table are kept until restart",
                extra={"tiers": sorted(gone)},
            )
            table = table.model_copy(update={"tiers": {**gone, **table.tiers}})
    return Limits(table)


class TableLimits:
    """The Limits of whichever tier table is in force (`table()`: read at each decision, so a
    swapped table applies from the next one), made once per table."""

    def __init__(self, table: Callable[[], TierTable]) -> None:
        self._table = table
        self._source: TierTable | None = None
        self._limits: Limits | None = None

    def policy(self, tenant: str, tier: str, own: TenantSpec | None = None) -> Policy:
        table = self._table()
        if self._limits is None or table is not self._source:
            self._limits, self._source = kept(table, self._limits), table
        return self._limits.policy(tenant, tier, own)


# Policies kept per table: one per tier, per tenant of `tenants:`, and per tenant whose own
# limits reached the limiter with a request (its spec's); past this many, made again.
MAX_POLICIES = 4096


def own_limits(requests: Limit | None, tokens: Limit | None) -> TenantSpec | None:
    """A tenant's own limits as Envoy's descriptors carry them (their `limit`: one unit of each
    kind), in the tier table's schema for them."""
    if requests is None and tokens is None:
        return None
    return TenantSpec(requests=_per_unit(requests), tokens=_per_unit(tokens))


def _per_unit(limit: Limit | None) -> PerUnit | None:
    return None if limit is None else PerUnit.model_validate({limit.unit.value: limit.amount})


class Limits:
    """Resolves (tenant, tier, own limits) to a Policy; resolutions are cached (the table is
    immutable)."""

    def __init__(self, config: TierTable) -> None:
        self.config = config
        self._tiers = config.all_tiers
        self._cache: dict[tuple[str, str, TenantSpec | None], Policy] = {}

    def policy(self, tenant: str, tier: str, own: TenantSpec | None = None) -> Policy:
        """`own`: the tenant's own limits and budgets the request carries (None: none)."""
        # Tenants without limits of their own share their tier's policy: the cache stays small.
        key = (
            tenant if tenant in self.config.tenants else "",
            tier if tier in self._tiers else "",
            own,
        )
        found = self._cache.get(key)
        if found is None:
            if len(self._cache) >= MAX_POLICIES:
                self._cache.clear()
            found = self._cache[key] = self._resolve(*key)
        return found

    def _resolve(self, tenant: str, tier: str, own: TenantSpec | None) -> Policy:
        name = tier or self.config.default_tier
        spec = self.config.tenant_spec(tenant, name, own)
        budget = spec.budget
        return Policy(
            tier=name,
            requests=_limits(spec.requests),
            tokens=_limits(spec.tokens),
            budget=Limit(budget.per, budget.tokens) if budget else None,
            shadow=spec.shadow,
            borrow_share=spec.borrow_share,
            retry_base_s=spec.retry_base_s,
            spend=tuple((per, int(amount * MICROS)) for per, amount in spec.spend.amounts())
            if spec.spend
            else (),
            prices=self.config.prices,
        )
