"""What a request costs in money: the price table, a `prices:` section of the tier table
(llmgw/tiers.py), hot-reloaded with it.

```yaml
prices:
  currency: USD                 # ISO 4217; every price and cost below is in it
  models:                       # per million tokens
    meta-llama/Llama-3.1-8B-Instruct: {input: 0.10, cached_input: 0.05, output: 0.40}
  default: {input: 0.20, output: 0.80}   # a model not listed; absent: such a model is unpriced
```

Costs are integer micro-units of the currency (a millionth of a dollar): a price per million
tokens times a token count is that many micro-units, so a cost is exact before its one rounding
(half up, once per request). The ledger stores them so (`cost_micros`); `llmgw usage` shows the
decimal amount.
"""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal

from pydantic import Field

from llmgw.config import Strict

MICROS = Decimal(1_000_000)  # micro-units in a unit of the currency
# A price per million tokens above any sold (a unit of the currency a token), and the most a
# request may cost: what the ledger's 64-bit column holds. No table can make a record unstorable.
MAX_PRICE = Decimal(1_000_000)
MAX_COST_MICROS = 2**63 - 1


class ModelPrice(Strict):
    """A model's prices per million tokens."""

    input: Decimal = Field(ge=0, le=MAX_PRICE, allow_inf_nan=False)
    # Prompt tokens the pod's prefix cache served; None: the input price.
    cached_input: Decimal | None = Field(default=None, ge=0, le=MAX_PRICE, allow_inf_nan=False)
    output: Decimal = Field(ge=0, le=MAX_PRICE, allow_inf_nan=False)

    def cost_micros(self, prompt: int, cached: int, completion: int) -> int:
        """The cost in micro-units of `prompt` tokens (of which `cached` were served from the
        prefix cache) and `completion` tokens."""
        cached = min(max(cached, 0), prompt)
        cached_price = self.input if self.cached_input is None else self.cached_input
        exact = (prompt - cached) * self.input + cached * cached_price + completion * self.output
        return min(int(exact.to_integral_value(ROUND_HALF_UP)), MAX_COST_MICROS)


class Prices(Strict):
    currency: str = Field(default="USD", pattern=r"^[A-Z]{3}$")
    models: dict[str, ModelPrice] = Field(default_factory=dict)
    default: ModelPrice | None = None

    def of(self, model: str) -> ModelPrice | None:
        """The model's prices; None: it has none (its requests cost nothing here)."""
        return self.models.get(model, self.default)


def amount(micros: int) -> Decimal:
    """Micro-units as the currency's decimal amount (6 places)."""
    return Decimal(micros) / MICROS
