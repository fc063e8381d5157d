"""The limits config: tiers (free, standard, platinum, custom) and per-tenant overrides.

```yaml
default_tier: free            # for a tier name the config does not know
tiers:                        # replaces the built-in tier of the same name; new names add tiers
  gold:
    requests: {second: 200, minute: 6000}      # units: second, minute, hour, day
    tokens: {minute: 1000000, day: unlimited}  # `unlimited` (or leaving the unit out): no limit
    budget: {tokens: 50000000, per: day}       # hard budget, fixed window → insufficient_quota
    borrow_share: 0.75                          # share of the fleet's borrowable capacity (0-1)
    retry_base_s: 1.5                           # base delay of the Retry-After formula
    shadow: false                               # decide and count, never refuse
tenants:                      # overrides merged over the tenant's tier, unit by unit
  acme: {tokens: {minute: 5000000}, shadow: true}
```
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from llmgw.config import Strict, read_yaml, validate
from ratelimit.types import Limit, Policy, Unit

Amount = Annotated[int, Field(ge=0)] | Literal["unlimited"]


class PerUnit(Strict):
    second: Amount | None = None
    minute: Amount | None = None
    hour: Amount | None = None
    day: Amount | None = None

    def merged(self, over: PerUnit | None) -> PerUnit:
        if over is None:
            return self
        return self.model_copy(update=over.model_dump(exclude_none=True))

    def limits(self) -> tuple[Limit, ...]:
        return tuple(
            Limit(unit, amount)
            for unit in Unit
            if isinstance(amount := getattr(self, unit.value), int)
        )


class Budget(Strict):
    tokens: int = Field(ge=0)
    per: Unit = Unit.DAY


class TierSpec(Strict):
    requests: PerUnit = PerUnit()
    tokens: PerUnit = PerUnit()
    budget: Budget | None = None
    borrow_share: float = Field(default=0.0, ge=0, le=1)
    retry_base_s: float = Field(default=1.0, gt=0)
    shadow: bool = False


class TenantSpec(Strict):
    requests: PerUnit | None = None
    tokens: PerUnit | None = None
    budget: Budget | None = None
    shadow: bool | None = None


DEFAULT_TIERS: dict[str, TierSpec] = {
    "free": TierSpec(
        requests=PerUnit(second=50, minute=600),
        tokens=PerUnit(minute=40_000),
        borrow_share=0.0,
        retry_base_s=4.0,
    ),
    "standard": TierSpec(
        requests=PerUnit(second=100, minute=3_000),
        tokens=PerUnit(minute=400_000),
        borrow_share=0.5,
        retry_base_s=2.0,
    ),
    "platinum": TierSpec(
        requests=PerUnit(second=500, minute=20_000),
        tokens=PerUnit(minute=2_000_000),
        borrow_share=1.0,
        retry_base_s=1.0,
    ),
}


class LimitsConfig(Strict):
    default_tier: str = "free"
    tiers: dict[str, TierSpec] = Field(default_factory=dict)
    tenants: dict[str, TenantSpec] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _known_default(self) -> LimitsConfig:
        if self.default_tier not in self.all_tiers:
            raise ValueError(f"default_tier {self.default_tier!r} is not a tier")
        return self

    @property
    def all_tiers(self) -> dict[str, TierSpec]:
        return DEFAULT_TIERS | self.tiers


def load_limits(path: Path | None) -> LimitsConfig:
    """The limits file, validated (errors name the file and the key); built-in tiers if None."""
    if path is None:
        return LimitsConfig()
    return validate(LimitsConfig, read_yaml(path), str(path))


class Limits:
    """Resolves (tenant, tier) to a Policy; resolutions are cached (config is immutable)."""

    def __init__(self, config: LimitsConfig) -> None:
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
            requests=spec.requests.merged(over.requests).limits(),
            tokens=spec.tokens.merged(over.tokens).limits(),
            budget=Limit(budget.per, budget.tokens) if budget else None,
            shadow=spec.shadow if over.shadow is None else over.shadow,
            borrow_share=spec.borrow_share,
            retry_base_s=spec.retry_base_s,
        )
