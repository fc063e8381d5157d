"""Soft limits of the money budgets: an alert (`spend_threshold`) when the costs settled in a
tenant's budget window reach each of its `spend.alert_at` percentages, once per window and
percentage across every ledger replica. A tenant's budgets are its tier's with its own merged
over them: its tier-table entry's, then its spec's, as its request's metadata carried them.

The settled costs are settle.lua's answer (a counter of their own beside the budget's, which
also holds the reservations outstanding), with the day or month they were charged to by Redis's
clock, so a threshold is reported at the settlement that reaches it, under its own window. Each
alert is claimed with one SET NX in Redis (only when this replica has not seen it claimed yet: at
most a few per tenant and period), so a second ledger replica does not send it again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from decimal import Decimal

from llmgw.outcome import Outcome
from llmgw.prices import MICROS, amount
from llmgw.resp import Client
from llmgw.tiers import Period, TenantSpec, TierTable
from llmgw.wire import tenant_prefix

# A claim outlives its window (the longest month) and a late settlement.
CLAIM_TTL_MS = 62 * 86_400_000
MAX_SEEN = 100_000  # claims made here; past it forgotten (Redis still answers)

Emit = Callable[..., object]


class SpendAlerts:
    def __init__(self, tiers: Callable[[], TierTable], emit: Emit) -> None:
        self.tiers = tiers
        self.emit = emit
        self._seen: set[tuple[str, Period, int, int]] = set()

    def reached(
        self, outcome: Outcome, spent: Sequence[tuple[str, int, int]]
    ) -> list[tuple[Period, int, int, int, Decimal]]:
        """The (period, bucket, percentage, micro-units settled, budget) this tenant's windows
        reached, as one settlement left them, not yet claimed here."""
        own = None if outcome.spend is None else TenantSpec(spend=outcome.spend)
        spec = self.tiers().tenant_spec(outcome.tenant, outcome.tier, own).spend
        if spec is None:
            return []
        budgets = dict(spec.amounts())
        out = []
        for name, index, held in spent:
            try:
                per = Period(name.removeprefix("spend:"))
            except ValueError:
                continue
            budget = budgets.get(per)
            if budget is None:
                continue
            for pct in spec.percentages:
                key = (outcome.tenant, per, index, pct)
                if key not in self._seen and held * 100 >= budget * MICROS * pct:
                    out.append((per, index, pct, held, budget))
        return out

    async def settled(
        self, client: Client, settled: Sequence[tuple[Outcome, Sequence[tuple[str, int, int]]]]
    ) -> None:
        """Claim and send the alerts these settlements reached."""
        currency = self.tiers().prices.currency
        for outcome, spent in settled:
            for per, index, pct, held, budget in self.reached(outcome, spent):
                claim = f"{tenant_prefix(outcome.tenant)}:spendalert:{per}:{index}:{pct}"
                claimed = await client.call("SET", claim, 1, "NX", "PX", CLAIM_TTL_MS)
                if len(self._seen) >= MAX_SEEN:
                    self._seen.clear()
                self._seen.add((outcome.tenant, per, index, pct))  # claimed, here or elsewhere
                if claimed is None:
                    continue  # another replica sent it
                self.emit(
                    "spend_threshold",
                    tenant=outcome.tenant,
                    tier=outcome.tier,
                    detail={
                        "period": per.value,
                        "percent": pct,
                        "spent": str(amount(held)),
                        "budget": str(budget),
                        "currency": currency,
                    },
                )
