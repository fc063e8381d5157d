"""Service received per tenant: the order of dispatch within a priority band (extauthz/queue.py),
least served first, as in virtual-token-counter and least-attained-service scheduling.

Each dispatch adds its request's tokens (its reservation: prompt + output cap × sequences) to its
tenant's count, which decays with half-life `half_life_s`, so that a tenant's past weighs less
the older it is. Counting tokens, not requests, is what keeps a tenant that sends fewer, larger
requests from taking more than its share. A tenant that comes back to a band where others wait
starts at the least count among them (`lift`), not at what its count decayed to: it goes next,
but does not then take every seat until it has caught up.

Approximate: the reservation, not what the pod served (an answer that stops early counts its
cap); and each replica counts its own dispatches (replicas share no fairness state yet).
"""

from __future__ import annotations

import math


class Served:
    def __init__(self, half_life_s: float) -> None:
        self.rate = math.log(2) / half_life_s
        self._counts: dict[str, tuple[float, float]] = {}  # tenant: (count, when)

    def of(self, tenant: str, now: float) -> float:
        found = self._counts.get(tenant)
        if found is None:
            return 0.0
        count, at = found
        return count * math.exp(-self.rate * (now - at)) if now > at else count

    def add(self, tenant: str, tokens: float, now: float) -> None:
        self._counts[tenant] = (self.of(tenant, now) + tokens, now)

    def lift(self, tenant: str, floor: float, now: float) -> None:
        """The tenant's count at least `floor`."""
        if self.of(tenant, now) < floor:
            self._counts[tenant] = (floor, now)

    def forget(self, keep: set[str]) -> None:
        """Only the tenants in `keep` (those the tenants file still has) remembered."""
        for tenant in [t for t in self._counts if t not in keep]:
            del self._counts[tenant]
