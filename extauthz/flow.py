"""Flow control: while a model's fleet is saturated, admitted requests wait here (their checks
held) and are dispatched in a fair, priority-aware order as seats free; the director's stage
between admit and pick (extauthz/director.py).

- Seats (router/saturation.py): a request goes at once when a pod serving its model has a seat
  free for it and nobody waits before it; else it waits in the model's queue (extauthz/queue.py:
  weighted priority bands, least-served tenant first within a band).
- Headroom: the last `headroom` share of a model's seats are only for tenants below their fair
  share of them, in seats (its seats / the tenants holding or waiting for one) or in service
  (below their mean), so a tenant that floods the fleet leaves seats free for a newcomer's first
  request, instead of making it wait for one of the flood's streams to end. A tenant's holds
  are this replica's dispatches not yet ended (the router's outcome feed; `hold_ttl_s` at most).
- Deadlines and bounds: a request waits at most its tier's queue_timeout_s (within `max_wait_s`)
  and the queue holds at most `max_queued` requests and `max_queued_bytes` of bodies (per tenant:
  `tenant_max_queued`, `tenant_max_queued_bytes`); past either the request is refused at once,
  429 `queue_timeout` / `queue_full`, with a retry-after from the model's measured drain rate.
- No pod usable (every pod serving the model down or erroring): nothing to wait for; requests
  go on as without flow control, to the router's pick or Envoy's fallback.
- Wake-ups: an outcome of a request this replica picked (the router's access log: its seat is
  free at once, unless a scrape that started after its last byte left the pod shows it already;
  batched every 20 ms for a request dispatched from the queue or into a fleet whose seats were
  taken from `outcome_soon_from` on, else with the rest every 0.2 s: `Free.soon`) and a scrape
  stored (every scrape_interval, each replica scrapes every pod: anyone's seats) are when seats
  free; a pick holds its seat on top of the scrapes until one shows it arrived (router/fleet.py
  `unseen`, `ended`). The mark is decided at dispatch: a stream that began below the mark's
  bound and ends in a saturated fleet frees its seat by the next scrape (75 ms) or its batch
  (0.2 s), and so do the checks of a burst into an idle fleet that were decided at once (they
  saw the same seats).

Per replica: each replica queues and counts holds alone; seats are the fleet's, read from the
same scrapes by all, so replicas that dispatch into the same free seat within one scrape interval
overfill it by at most one request each (the pod's own queue takes it). The service counts that
order a band are merged through Redis (extauthz/fairness.py `Sharing`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from extauthz import metrics
from extauthz.fairness import Served
from extauthz.queue import ModelQueue, Waiter
from extauthz.settings import FlowSettings
from router.lifecycle import Lifecycle
from router.saturation import Seats, seats
from router.types import PodId

DRAIN_SAMPLES = 64  # dispatches per model the drain rate is measured over
UNKNOWN_DRAIN_S = 5  # retry-after when no dispatch was measured yet
MAX_RETRY_S = 60
# Below its fair share in service means below this share of the mean: a tenant back from idle
# starts level with the least served, and a hair's difference must not decide the headroom.
SERVICE_BELOW = 0.9


def _went(w: Waiter) -> bool:
    """Dispatched, though its wait ended (its deadline, its client) before it saw it."""
    return w.dispatched.done() and not w.dispatched.cancelled()


@dataclass(frozen=True, slots=True)
class Free:
    """Where a request may go at once: the pods with a seat free for it (empty: no pod is usable,
    and it goes on as without flow control), and whether its outcome is wanted at once (the
    model's seats are taken from `outcome_soon_from` on)."""

    pods: frozenset[PodId]
    soon: bool


@dataclass(frozen=True, slots=True)
class Refused:
    code: str  # queue_full or queue_timeout
    retry_after_s: int


class Holds:
    """Each tenant's dispatched requests not yet ended, per model: by request ID until the outcome
    feed ends it, or `ttl_s` (a stream longer than that stops counting)."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._by_id: OrderedDict[str, tuple[str, str, float]] = OrderedDict()
        self.counts: dict[tuple[str, str], int] = {}  # (model, tenant): holds

    def add(self, request_id: str, model: str, tenant: str, now: float) -> None:
        if not request_id or request_id in self._by_id:
            return
        self._by_id[request_id] = (model, tenant, now)
        key = (model, tenant)
        self.counts[key] = self.counts.get(key, 0) + 1
        while self._by_id:
            oldest = next(iter(self._by_id))
            if now - self._by_id[oldest][2] < self.ttl_s:
                break
            self.end(oldest)

    def end(self, request_id: str) -> bool:
        found = self._by_id.pop(request_id, None)
        if found is None:
            return False
        key = found[:2]
        left = self.counts[key] - 1
        if left:
            self.counts[key] = left
        else:
            del self.counts[key]
        return True

    def of(self, model: str, tenant: str) -> int:
        return self.counts.get((model, tenant), 0)

    def tenants(self, model: str) -> set[str]:
        return {t for m, t in self.counts if m == model}


class FlowControl:
    def __init__(
        self,
        settings: FlowSettings,
        router: Lifecycle,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.router = router
        self.clock = clock
        self.served = Served(settings.half_life_s)
        self.holds = Holds(settings.hold_ttl_s)
        self.queues: dict[str, ModelQueue] = {}
        self.length = 0
        self.bytes = 0
        self.tenant_length: dict[str, int] = {}
        self.tenant_bytes: dict[str, int] = {}
        self._drains: dict[str, deque[float]] = {}
        self._pumping = False
        router.fleet.listeners.append(self._scraped)
        router.end_listeners.append(self._ended)

    # The director's view.

    def free_for(self, model: str, tenant: str) -> Free | None:
        """Where the tenant's request may go now; None: it must wait (nobody may go before those
        waiting, and no seat is free for it)."""
        queue = self.queues.get(model)
        if queue is not None and queue.length:
            return None
        found = self._seats(model)
        if not found.total:  # no pod usable: not for the queue to wait out (Envoy's fallback)
            return Free(frozenset(), soon=False)
        metrics.saturated(self._label(model)).set(0.0 if found.free else 1.0)
        if not found.free or not self._headroom(model, found)(tenant):
            return None
        taken = found.total - found.free_total + 1
        return Free(frozenset(found.free), taken >= self.settings.outcome_soon_from * found.total)

    def dispatched(self, model: str, band: int, tenant: str, request_id: str, tokens: int) -> None:
        """A request that went at once: its tenant's service and hold."""
        self._count(model, band, tenant, request_id, tokens, 0.0)

    async def wait(self, w: Waiter, model: str, deadline_s: float) -> Refused | float:
        """Wait for a seat: the seconds waited once `w` was dispatched (picked), or the
        refusal. A client that leaves (the check cancelled) leaves the queue at once."""
        if self._full(w):
            metrics.refusals(w.tenant, "queue_full").inc()
            return Refused("queue_full", self._retry_after(model))
        queue = self.queues.get(model)
        if queue is None:
            queue = self.queues[model] = ModelQueue(self._weight)
        now = self.clock()
        if not queue.waiting(w.tenant) and not self.holds.of(model, w.tenant):  # back from idle
            floor = queue.least_served(w.band, lambda t: self.served.of(t, now))
            if floor is not None:
                self.served.lift(w.tenant, floor, now)
        queue.push(w)
        self._joined(w, model, +1)
        self._schedule()
        try:
            async with asyncio.timeout(deadline_s):
                await w.dispatched
        except TimeoutError:
            if not _went(w):
                self._leave(queue, w, model, "queue_timeout")
                return Refused("queue_timeout", self._retry_after(model))
        except asyncio.CancelledError:
            if not _went(w):
                self._leave(queue, w, model, "cancelled")
            raise
        return self.clock() - w.at

    def ended(self, request_id: str) -> None:
        """A dispatched request that did not go after all (its check cancelled, or refused)."""
        if self.holds.end(request_id):
            self._schedule()

    # Dispatch.

    def _scraped(self, pod: PodId) -> None:
        if self.length:
            self._schedule()

    def _ended(self, request_id: str) -> None:
        self.ended(request_id)

    def _schedule(self) -> None:
        if not self._pumping and self.length:
            self._pumping = True
            asyncio.get_running_loop().call_soon(self._pump)

    def _pump(self) -> None:
        """Dispatch every waiter a seat is free for, in the queues' order."""
        self._pumping = False
        now = self.clock()
        for model, queue in self.queues.items():
            while queue.length:
                found = self._seats(model)
                if found.total and not found.free:
                    break
                w = queue.pop(self._headroom(model, found), partial(self.served.of, now=now))
                if w is None:
                    break
                self._joined(w, model, -1)
                if w.dispatched.cancelled():  # its check is gone; it has not seen it yet
                    continue
                w.pick(frozenset(found.free))
                self._count(model, w.band, w.tenant, w.request_id, w.tokens, now - w.at)
                w.dispatched.set_result(None)

    def _leave(self, queue: ModelQueue, w: Waiter, model: str, reason: str) -> None:
        if queue.remove(w):
            self._joined(w, model, -1)
        metrics.refusals(w.tenant, reason).inc()

    def _count(
        self,
        model: str,
        band: int,
        tenant: str,
        request_id: str | None,
        tokens: int,
        waited: float,
    ) -> None:
        now = self.clock()
        self.served.add(tenant, tokens, now)
        if request_id:
            self.holds.add(request_id, model, tenant, now)
        self._drains.setdefault(model, deque(maxlen=DRAIN_SAMPLES)).append(now)
        metrics.dispatches(tenant, "true" if waited > 0 else "false").inc()
        metrics.queue_wait(self._label(model), str(band)).observe(waited)
        metrics.service_tokens(tenant).set(self.served.of(tenant, now))

    # Rules.

    def _seats(self, model: str) -> Seats:
        return seats(self.router.fleet, self.router.bounds, model or None)

    def _headroom(self, model: str, found: Seats) -> Callable[[str], bool]:
        """The headroom rule, for one dispatch: the last seats only for a tenant below its fair
        share, in seats (the model's seats / the tenants holding or waiting for one) or in
        service (below their mean). By seats alone two backlogged tenants would split the fleet
        evenly, whatever their prompts; by service, the one whose requests are smaller may hold
        more seats until its tokens served catch up."""
        reserve = math.ceil(self.settings.headroom * found.total)
        if not found.total or found.free_total > reserve:
            return lambda tenant: True
        queue = self.queues.get(model)
        active = self.holds.tenants(model) | (queue.tenants() if queue else set())
        now = self.clock()
        total = sum(self.served.of(t, now) for t in active)

        def below(tenant: str) -> bool:
            tenants, served = len(active), total
            mine = self.served.of(tenant, now)
            if tenant not in active:  # a newcomer
                tenants, served = tenants + 1, served + mine
            fair_seats, fair_service = found.total / tenants, served / tenants
            return self.holds.of(model, tenant) < fair_seats or mine < fair_service * SERVICE_BELOW

        return below

    def _weight(self, band: int) -> float:
        return self.settings.band_weights.get(band, float(band))

    def _full(self, w: Waiter) -> bool:
        s = self.settings
        return (
            self.length >= s.max_queued
            or self.tenant_length.get(w.tenant, 0) >= s.tenant_max_queued
            or self.bytes + w.body_bytes > s.max_queued_bytes
            or self.tenant_bytes.get(w.tenant, 0) + w.body_bytes > s.tenant_max_queued_bytes
        )

    def _joined(self, w: Waiter, model: str, sign: int) -> None:
        self.length += sign
        self.bytes += sign * w.body_bytes
        for counts, n in ((self.tenant_length, 1), (self.tenant_bytes, w.body_bytes)):
            left = counts.get(w.tenant, 0) + sign * n
            if left > 0:
                counts[w.tenant] = left
            else:
                counts.pop(w.tenant, None)
        metrics.queue_length(self._label(model), str(w.band)).inc(sign)

    def _retry_after(self, model: str) -> int:
        """Seconds until the model's queue, as long as it is now, has drained at the rate
        measured over its latest dispatches."""
        times = self._drains.get(model)
        queue = self.queues.get(model)
        waiting = (queue.length if queue is not None else 0) + 1
        if times is None or len(times) < 2 or times[-1] <= times[0]:
            return UNKNOWN_DRAIN_S
        rate = (len(times) - 1) / (times[-1] - times[0])
        return min(MAX_RETRY_S, max(1, math.ceil(waiting / rate)))

    def _label(self, model: str) -> str:
        served = self.router.fleet.served_models()
        return model if served is not None and model in served else "other"
