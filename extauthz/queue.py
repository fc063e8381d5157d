"""One model's flow-control queue and its dispatch order: pure, no clock or I/O of its own.

- Priority bands (the tenant's priority, 1-10) share dispatches by weight, not strictly: among
  the bands with a request that may go, the one least served relative to its weight goes next
  (stride scheduling: each dispatch advances its band's pass by 1/weight; a band that was empty
  starts at the pass of the latest dispatch, so it cannot claim the turns it missed). Band p
  against band q gets weight(p) / (weight(p) + weight(q)) of the dispatches: none starves.
- Within a band, the tenant least served (extauthz/fairness.py) goes next; a tenant's own
  requests go in arrival order.
- Whether a tenant may take a seat now (flow control's headroom rule) is the caller's
  `eligible`: a band whose waiting tenants may not is skipped, not blocking the others.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from router.types import PodId


@dataclass(eq=False, slots=True)
class Waiter:
    tenant: str
    band: int
    tokens: int  # the service its dispatch adds (its reservation)
    body_bytes: int  # what Envoy holds for it meanwhile
    at: float  # when it started waiting (monotonic)
    # At its dispatch: its pick among the pods with a seat free (their IDs), counted in flight
    # at once, so that the next dispatch sees the seat taken.
    pick: Callable[[frozenset[PodId]], None]
    request_id: str | None = None
    # Resolved when it is dispatched (picked); cancelled with its check.
    dispatched: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


@dataclass(slots=True)
class _Band:
    weight: float
    tenants: dict[str, deque[Waiter]] = field(default_factory=dict)
    passed: float = 0.0


class ModelQueue:
    def __init__(self, weight: Callable[[int], float]) -> None:
        self.weight = weight
        self._bands: dict[int, _Band] = {}
        self._vtime = 0.0  # the pass of the latest dispatch
        self.length = 0
        self.tenant_length: dict[str, int] = {}

    def waiting(self, tenant: str) -> bool:
        return tenant in self.tenant_length

    def tenants(self) -> set[str]:
        return set(self.tenant_length)

    def band_length(self, band: int) -> int:
        found = self._bands.get(band)
        return 0 if found is None else sum(len(q) for q in found.tenants.values())

    def push(self, w: Waiter) -> None:
        band = self._bands.get(w.band)
        if band is None:
            band = self._bands[w.band] = _Band(self.weight(w.band), passed=self._vtime)
        elif not band.tenants:
            band.passed = max(band.passed, self._vtime)
        band.tenants.setdefault(w.tenant, deque()).append(w)
        self.length += 1
        self.tenant_length[w.tenant] = self.tenant_length.get(w.tenant, 0) + 1

    def least_served(self, band: int, served: Callable[[str], float]) -> float | None:
        """The least service among the band's waiting tenants; None: none waits."""
        found = self._bands.get(band)
        if found is None or not found.tenants:
            return None
        return min(served(t) for t in found.tenants)

    def remove(self, w: Waiter) -> bool:
        """A waiter leaving without dispatch (its deadline, its client gone); False: not here."""
        band = self._bands.get(w.band)
        waiting = band.tenants.get(w.tenant) if band is not None else None
        if band is None or waiting is None or w not in waiting:
            return False
        waiting.remove(w)
        self._left(band, w)
        return True

    def pop(self, eligible: Callable[[str], bool], served: Callable[[str], float]) -> Waiter | None:
        """The next waiter to dispatch, removed; None: nobody who may go waits."""
        best: tuple[float, int, str] | None = None  # (pass, -band, tenant)
        for number, band in self._bands.items():
            if not band.tenants or (best is not None and (band.passed, -number) >= best[:2]):
                continue
            chosen = [t for t in band.tenants if eligible(t)]
            if chosen:
                tenant = min(chosen, key=served)
                best = (band.passed, -number, tenant)
        if best is None:
            return None
        passed, number, tenant = best
        band = self._bands[-number]
        w = band.tenants[tenant].popleft()
        self._vtime = passed
        band.passed = passed + 1.0 / band.weight
        self._left(band, w)
        return w

    def _left(self, band: _Band, w: Waiter) -> None:
        if not band.tenants[w.tenant]:
            del band.tenants[w.tenant]
        self.length -= 1
        left = self.tenant_length[w.tenant] - 1
        if left:
            self.tenant_length[w.tenant] = left
        else:
            del self.tenant_length[w.tenant]
