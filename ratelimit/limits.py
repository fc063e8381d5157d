"""A tenant's limits, resolved from the tier table (llmgw/tiers.py) into a Policy."""

from __future__ import annotations

from llmgw.tiers import PerUnit, TenantSpec, TierTable
from ratelimit.types import Limit, Policy


def _limits(per: PerUnit) -> tuple[Limit, ...]:
    return tuple(Limit(unit, amount) for unit, amount in per.amounts())


class Limits:
    """Resolves (tenant, tier) to a Policy; resolutions are cached (config is immutable)."""

    def __init__(self, config: TierTable) -> None:
        self.config = config
        self._tiers = config.all_tiers
        self._cache: dict[tuple[str, str], Policy] = {}

    def policy(self, tenant: str, tier: str) -> Policy:
        # Tenants without overrides share their tier's policy: the cache stays bounded.
        key = (tenant if tenant in self.config.tenants else "", tier if tier in self._tiers else "")
        found = self._cache.get(key)
        if found is None:
            found = self._cache[key] = self._resolve(*key)
        return found

    def _resolve(self, tenant: str, tier: str) -> Policy:
        name = tier or self.config.default_tier
        spec = self._tiers[name]
        over = self.config.tenants.get(tenant, TenantSpec())
        budget = over.budget or spec.budget
        return Policy(
            tier=name,
            requests=_limits(spec.requests.merged(over.requests)),
            tokens=_limits(spec.tokens.merged(over.tokens)),
            budget=Limit(budget.per, budget.tokens) if budget else None,
            shadow=spec.shadow if over.shadow is None else over.shadow,
            borrow_share=spec.borrow_share,
            retry_base_s=spec.retry_base_s,
        )
