"""The tier table: every tier defined once, read by every service that needs one.

One YAML file, every service's `tiers_file` (and the stack's: `llmgw up`; once `limits_file`
and `ratelimit_limits`, names still read with a warning), holds the tiers; the built-in ones
apply when it is absent:

```yaml
default_tier: free            # for a tier name the table does not know
tiers:                        # replaces the built-in tier of the same name; new names add tiers
  gold:
    requests: {second: 200, minute: 6000}      # units: second, minute, hour, day
    tokens: {minute: 1000000, day: unlimited}  # `unlimited` (or leaving the unit out): no limit
    budget: {tokens: 50000000, per: day}       # hard budget, fixed window → insufficient_quota
    spend: {day: 25.00, month: 500.00}         # money budgets (prices' currency), like `budget`
    borrow_share: 0.75                          # share of the fleet's borrowing pool (0-1)
    retry_base_s: 1.5                           # base delay of the Retry-After formula
    shadow: false                               # decide and count, never refuse
    max_output_tokens: 8192                     # the output cap the pod gets (default: extauthz's)
    breaker: {threshold: 2, cooldown_s: 30, cooldown_max_s: 240}  # llmgw/breaker.py; none: off
    queue_timeout_s: 10                         # longest wait in flow control's queue
tenants:                      # a tenant's overrides, merged over its tier unit by unit
  acme: {tokens: {minute: 5000000}, shadow: true}
prices:                       # money per million tokens (llmgw/prices.py)
  currency: USD
  models: {meta-llama/Llama-3.1-8B-Instruct: {input: 0.10, cached_input: 0.05, output: 0.40}}
```

A tenant names its tier in the tenants file (extauthz), which refuses a tier this table does not
define. A tenant's own limits are stated here, under `tenants:`, or in its spec (the tenants
file's or the admin API's `limits: {rpm, tpm}`, `budget`, `spend`: extauthz/types.py Tenant),
which travels with each request and is merged over this entry by the same rule,
TierTable.tenant_spec. Both files reload while running: parse → validate → swap, the last good
one kept.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from llmgw.breaker import BreakerSpec, seed
from llmgw.config import Strict, read_yaml, validate
from llmgw.prices import Prices
from llmgw.reload import Reloading


class Unit(StrEnum):
    SECOND = "second"
    MINUTE = "minute"
    HOUR = "hour"
    DAY = "day"


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

    def amounts(self) -> tuple[tuple[Unit, int], ...]:
        """The limited units and their amounts, shortest unit first."""
        return tuple(
            (unit, amount) for unit in Unit if isinstance(amount := getattr(self, unit.value), int)
        )


class Budget(Strict):
    tokens: int = Field(ge=0)
    per: Unit = Unit.DAY


class Period(StrEnum):
    """A money budget's period: the UTC day or the UTC calendar month."""

    DAY = "day"
    MONTH = "month"


def month_index(ms: int) -> int:
    """The UTC calendar month of an instant, as year × 12 + month − 1 (llmgw/reservation.lua's
    rs_month)."""
    at = datetime.fromtimestamp(ms // 1000, UTC)
    return at.year * 12 + at.month - 1


def month_start(index: int) -> int:
    """When a month_index begins (ms)."""
    return int(datetime(index // 12, index % 12 + 1, 1, tzinfo=UTC).timestamp()) * 1000


# The most a money budget may be, in units of the currency: its micro-units stay below the
# limiter's largest count (ratelimit/types.py MAX_COUNT, 2^48).
MAX_SPEND = Decimal(100_000_000)
# Micro-units are the unit of every count (llmgw/prices.py MICROS): no finer amount.
Money = Annotated[Decimal, Field(ge=0, le=MAX_SPEND, allow_inf_nan=False, decimal_places=6)]
Percent = Annotated[int, Field(ge=1, le=100)]
ALERT_AT: tuple[int, ...] = (50, 80, 100)  # a money budget's soft limits unless stated


class Spend(Strict):
    """Money budgets, in the price table's currency: spent requests are priced (llmgw/prices.py),
    reserved at admission at their worst case and settled at their cost, as `budget` is in
    tokens. A model without a price costs nothing here."""

    day: Money | None = None
    month: Money | None = None
    # Percentages of each budget at which the ledger alerts (`spend_threshold`), once a period;
    # None: as its tier's (merged), else ALERT_AT. A few, each once: every request carries them.
    alert_at: tuple[Percent, ...] | None = Field(default=None, min_length=1, max_length=10)

    @field_validator("alert_at")
    @classmethod
    def _distinct(cls, value: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if value is not None and len(set(value)) != len(value):
            raise ValueError("each percentage once")
        return None if value is None else tuple(sorted(value))

    @property
    def percentages(self) -> tuple[int, ...]:
        return ALERT_AT if self.alert_at is None else self.alert_at

    def amounts(self) -> tuple[tuple[Period, Decimal], ...]:
        return tuple(
            (period, amount)
            for period in Period
            if (amount := getattr(self, period.value)) is not None
        )


class TierSpec(Strict):
    requests: PerUnit = PerUnit()
    tokens: PerUnit = PerUnit()
    budget: Budget | None = None
    spend: Spend | None = None
    borrow_share: float = Field(default=0.0, ge=0, le=1)
    retry_base_s: float = Field(default=1.0, gt=0)
    shadow: bool = False
    # The output cap per sequence the pod receives when the client names none (and the most it
    # may name); None: extauthz's decision.max_output_tokens.
    max_output_tokens: int | None = Field(default=None, ge=1)
    # The tenant breaker (llmgw/breaker.py); None: none. A tier that replaces a built-in one
    # states its own.
    breaker: BreakerSpec | None = None
    # The longest a request of this tier waits in flow control's queue while the fleet is
    # saturated (extauthz/flow.py), within extauthz's flow.max_wait_s; past it a 429
    # queue_timeout.
    queue_timeout_s: float = Field(default=10.0, gt=0)


class TenantSpec(Strict):
    requests: PerUnit | None = None
    tokens: PerUnit | None = None
    budget: Budget | None = None
    spend: Spend | None = None
    shadow: bool | None = None


BUILTIN_TIERS: dict[str, TierSpec] = {
    "free": TierSpec(
        requests=PerUnit(second=50, minute=600),
        tokens=PerUnit(minute=40_000),
        borrow_share=0.0,
        retry_base_s=4.0,
        queue_timeout_s=5.0,
        # Two failures, not one (a single request never trips: one broken stream weighed 1.0
        # against 1.0 − 0.05 before); 20 mistakes in a burst.
        breaker=seed(cooldown_s=120.0, threshold=2.0, mistakes_threshold=6.0),
    ),
    "standard": TierSpec(
        requests=PerUnit(second=100, minute=3_000),
        tokens=PerUnit(minute=400_000),
        borrow_share=0.5,
        retry_base_s=2.0,
        breaker=seed(cooldown_s=30.0, threshold=2.0, mistakes_threshold=9.0),
    ),
    "platinum": TierSpec(
        requests=PerUnit(second=500, minute=20_000),
        tokens=PerUnit(minute=2_000_000),
        borrow_share=1.0,
        retry_base_s=1.0,
        queue_timeout_s=20.0,
        # Half of standard's cool-down, and the support hook told of every trip.
        breaker=seed(cooldown_s=15.0, threshold=3.0, mistakes_threshold=12.0, alert=True),
    ),
}


class TierTable(Strict):
    default_tier: str = "free"
    tiers: dict[str, TierSpec] = Field(default_factory=dict)
    tenants: dict[str, TenantSpec] = Field(default_factory=dict)
    prices: Prices = Prices()  # what requests cost in money (llmgw/prices.py)

    @model_validator(mode="after")
    def _known_default(self) -> TierTable:
        if self.default_tier not in self.all_tiers:
            raise ValueError(f"default_tier {self.default_tier!r} is not a tier")
        return self

    @property
    def all_tiers(self) -> dict[str, TierSpec]:
        return BUILTIN_TIERS | self.tiers

    def tier(self, name: str) -> TierSpec:
        """A tier by name; one the table does not know is the default tier."""
        tiers = self.all_tiers
        return tiers.get(name) or tiers[self.default_tier]

    def tenant_spec(self, tenant: str, tier: str, over: TenantSpec | None = None) -> TierSpec:
        """The limits a tenant of `tier` runs under: the tier's, with the tenant's own (its entry
        in `tenants:`, then `over`: what reached the limiter with the request) merged over them
        unit by unit. The one merge of a tenant's own limits."""
        spec = self.tier(tier)
        for own in (self.tenants.get(tenant), over):
            if own is not None:
                spec = spec.model_copy(
                    update={
                        "requests": spec.requests.merged(own.requests),
                        "tokens": spec.tokens.merged(own.tokens),
                        "budget": own.budget or spec.budget,
                        "spend": _spend(spec.spend, own.spend),
                        "shadow": spec.shadow if own.shadow is None else own.shadow,
                    }
                )
        return spec

    def token_ceiling(self, tenant: str, tier: str, over: TenantSpec | None = None) -> int | None:
        """The smallest token limit a tenant of `tier` runs under (rate windows and budget);
        None: none. No reservation above it can pass."""
        spec = self.tenant_spec(tenant, tier, over)
        budget = [spec.budget.tokens] if spec.budget else []
        return min([a for _, a in spec.tokens.amounts()] + budget, default=None)


def _spend(tier: Spend | None, own: Spend | None) -> Spend | None:
    """A tenant's money budgets over its tier's, period by period (its alert_at, when stated):
    by value, so a spec stored with every field (the admin API's) merges as one that names
    only its own."""
    if own is None or tier is None:
        return own or tier
    return tier.model_copy(update=own.model_dump(exclude_none=True))


def watched_tiers(path: Path | None) -> Reloading[TierTable]:
    """The tier table of a process, kept current while it runs: loaded once per process and
    handed to every reader there, so that all of them decide by the same table."""
    return Reloading("tiers", [path] if path else [], lambda _: load_tiers(path))


def load_tiers(path: Path | None) -> TierTable:
    """The tier table file, validated (errors name the file and the key); built-ins if None."""
    if path is None:
        return TierTable()
    return validate(TierTable, read_yaml(path), str(path))
