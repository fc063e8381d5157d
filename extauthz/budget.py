"""Body bytes in flight in this process (one extauthz replica), per tenant and in total.

A check holds its body's declared length from its head until it is answered: received, queued
for or read in the body pool, decided. A check that would take a tenant past its share, or the
process past its total, is refused at once (never queued), so no caller can make extauthz hold
more than the total, whatever the mix of bodies (the pool's queue included: it only ever holds
bodies that hold their bytes here)."""

from __future__ import annotations

from typing import Literal

Over = Literal["tenant", "total"]


class Held:
    """Bytes one check holds; given back once, by whichever of its ends comes first."""

    __slots__ = ("_budget", "size", "tenant")

    def __init__(self, budget: BodyBudget, tenant: str, size: int) -> None:
        self._budget = budget
        self.tenant = tenant
        self.size = size

    def release(self) -> None:
        if self.size:
            self._budget.give_back(self.tenant, self.size)
            self.size = 0


class BodyBudget:
    def __init__(self, total: int, per_tenant: int) -> None:
        self.total = total
        self.per_tenant = per_tenant
        self.held = 0
        self.by_tenant: dict[str, int] = {}

    def take(self, tenant: str, size: int) -> Held | Over:
        """`size` bytes held for `tenant`, or which bound they would cross (the tenant's first:
        a tenant past its own share is refused as such, whatever the others hold)."""
        mine = self.by_tenant.get(tenant, 0)
        if mine + size > self.per_tenant:
            return "tenant"
        if self.held + size > self.total:
            return "total"
        if size:
            self.by_tenant[tenant] = mine + size
            self.held += size
        return Held(self, tenant, size)

    def give_back(self, tenant: str, size: int) -> None:
        self.held -= size
        left = self.by_tenant[tenant] - size
        if left:
            self.by_tenant[tenant] = left
        else:
            del self.by_tenant[tenant]  # no entry per tenant ever seen: a bounded dict
