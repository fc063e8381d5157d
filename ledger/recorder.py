"""Outcomes in; settled in Redis a batch at a time; counted; handed to the database writer.

Off the request path: Envoy sends its access log whenever it flushes, and this loop settles
whatever has arrived, one Redis round trip per batch, which also feeds the tenant breakers
(ledger/breaker.py). While Redis cannot be reached the outcomes
wait here (bounded: past `pending_max` the oldest are stored unsettled, their reservations stay
charged) and are settled when it returns, so no reservation is ever refunded twice or wrongly.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from ledger import metrics
from ledger.breaker import Breakers, Transition
from ledger.gputime import Batches
from ledger.settings import SettleSettings
from ledger.spending import SpendAlerts
from llmgw import wire
from llmgw.link import RedisLink
from llmgw.outcome import Outcome
from llmgw.prices import Prices
from llmgw.resp import RespError
from llmgw.serve import finish
from llmgw.settlement import Charge, Settled, settle

log = logging.getLogger("ledger.recorder")

FAILURES = (ConnectionError, OSError, TimeoutError, RespError)
_RESULTS = {0: "unreserved", 1: "settled", 2: "duplicate"}


class Sink(Protocol):
    def submit(self, records: Sequence[Outcome]) -> None: ...


class Watch(Protocol):
    """What the alert rules see (ledger/alerts.py)."""

    def observe(self, outcomes: Sequence[Outcome]) -> None: ...
    def unchecked(self, outcome: Outcome) -> None: ...


class Recorder:
    def __init__(
        self,
        redis: RedisLink,
        sink: Sink | None,
        *,
        batch_max: int,
        pending_max: int,
        done_ttl_s: float,
        timeout_s: float,
        retry_max_s: float,
        watch: Watch | None = None,
        breakers: Breakers | None = None,
        prices: Callable[[], Prices] = Prices,
        batches: Batches | None = None,
        spending: SpendAlerts | None = None,
    ) -> None:
        self.redis = redis
        self.spending = spending
        self.prices = prices
        self.batches = batches
        self.sink = sink
        self.watch = watch
        self.breakers = breakers
        self.batch_max = batch_max
        self.pending_max = pending_max
        self.done_ttl_ms = int(done_ttl_s * 1000)
        self.timeout_s = timeout_s
        self.retry_max_s = retry_max_s
        self._pending: collections.deque[Outcome] = collections.deque()
        self._wake = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._settling: list[Outcome] = []  # taken from _pending for the round trip in progress

    @classmethod
    def of(
        cls,
        redis: RedisLink,
        sink: Sink | None,
        settle: SettleSettings,
        watch: Watch | None = None,
        breakers: Breakers | None = None,
        prices: Callable[[], Prices] = Prices,
        batches: Batches | None = None,
        spending: SpendAlerts | None = None,
    ) -> Recorder:
        """A recorder as the settle settings size it (the ledger's, and the sidecar's);
        `prices`, the price table as it is now (the tier table's, reloaded); `batches`, the pods'
        batches for each record's GPU time (None: not estimated); `spending`, the money budgets'
        soft-limit alerts (None: none)."""
        return cls(
            redis,
            sink,
            batch_max=settle.batch_max,
            pending_max=settle.pending_max,
            done_ttl_s=settle.done_ttl_s,
            timeout_s=settle.timeout_s,
            retry_max_s=settle.retry_max_s,
            watch=watch,
            breakers=breakers,
            prices=prices,
            batches=batches,
            spending=spending,
        )

    def add(self, outcomes: Sequence[Outcome]) -> None:
        """Never blocks."""
        if self.watch is not None:  # on arrival: alerts must not wait for Redis
            self.watch.observe(outcomes)
        self._pending.extend(outcomes)
        overflow = len(self._pending) - self.pending_max
        if overflow > 0:
            dropped = [self._pending.popleft() for _ in range(overflow)]
            metrics.UNSETTLED_DROPPED.inc(overflow)
            self._store(dropped, None)
        metrics.PENDING.set(len(self._pending))
        self._wake.set()

    async def run(self) -> None:
        failures = 0
        while not (self._closing and not self._pending):
            if not self._pending:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), 1.0)
                continue
            batch = [
                self._pending.popleft() for _ in range(min(self.batch_max, len(self._pending)))
            ]
            self._settling = batch
            prices = self.prices()  # one table for a batch's charges and its records
            try:
                results = await self._settle(batch, prices)
            except FAILURES as exc:
                self._pending.extendleft(reversed(batch))
                self._settling = []
                metrics.SETTLE_FAILURES.inc()
                failures += 1
                if failures == 1:
                    log.warning("settlement failing; outcomes held", extra={"error": repr(exc)})
                if self._closing:
                    return
                await asyncio.sleep(min(0.05 * 2**failures, self.retry_max_s))
                continue
            if failures:
                log.info("settlement back", extra={"failed_batches": failures})
            failures = 0
            self._settling = []
            metrics.PENDING.set(len(self._pending))
            self._store(batch, results, prices)

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="ledger-settlement")

    async def close(self, drain_s: float) -> None:
        """Settle what is pending for up to `drain_s`; the rest is stored unsettled (its
        reservations stay charged)."""
        self._closing = True
        self._wake.set()
        await finish(self._task, drain_s)
        left = list(self._pending)
        self._pending.clear()
        self._store(left, None)
        await self.redis.close()

    @property
    def pending(self) -> int:
        """Outcomes not yet settled, the batch in flight included."""
        return len(self._pending) + len(self._settling)

    def holding(self, request_ids: set[str]) -> set[str]:
        """Which of these requests' outcomes wait here (ledger/reconcile.py: not lost)."""
        return {o.request_id for o in (*self._pending, *self._settling)} & request_ids

    async def _settle(self, batch: list[Outcome], prices: Prices) -> dict[int, Settled]:
        """Settlement of each outcome that belongs to a tenant, by its index in the batch; not
        of a refusal by the rate limiter, which reserved nothing (settled, its request ID would
        release a reservation made under the same ID by another request)."""
        charges = {
            i: Charge(
                o.tenant, o.request_id, o.prompt_tokens + o.completion_tokens, _cost(prices, o)
            )
            for i, o in enumerate(batch)
            if o.tenant and o.reserved
        }
        if not charges:
            return {}
        started = time.perf_counter()
        async with asyncio.timeout(self.timeout_s):
            client = await self.redis.get()
            settling = settle(client, list(charges.values()), self.done_ttl_ms)
            transitions: list[Transition] = []
            if self.breakers is None:
                settled = await settling
            else:  # both write every script before awaiting a reply: one round trip
                feeding = self.breakers.feed(client, batch)
                settled, transitions = await asyncio.gather(settling, feeding)
        metrics.SETTLE_SECONDS.observe(time.perf_counter() - started)
        if self.breakers is not None:
            self.breakers.record(transitions)
        results = dict(zip(charges, settled, strict=True))
        if self.spending is not None:
            reached = [(batch[i], r.spent) for i, r in results.items() if r.spent]
            if reached:
                try:
                    async with asyncio.timeout(self.timeout_s):
                        await self.spending.settled(client, reached)
                except FAILURES as exc:  # an alert lost, never a settlement
                    log.warning("spend alerts failed", extra={"error": repr(exc)})
        return results

    def _store(
        self,
        batch: list[Outcome],
        results: dict[int, Settled] | None,
        prices: Prices | None = None,
    ) -> None:
        """`prices`: the table the batch was settled by (None: the table in force)."""
        records = []
        prices = prices if prices is not None else self.prices()
        for i, o in enumerate(batch):
            result = results.get(i) if results is not None else None
            if o.tenant and o.pod and o.reserved_tokens and not o.quota_checked:
                metrics.unchecked(o.tenant).inc()  # the rate limiter failed open
                if self.watch is not None:
                    self.watch.unchecked(o)
            if result is None:  # unsettled or no tenant: what admission reserved stays charged
                charged = o.reserved_tokens if o.tenant and o.reserved else 0
            else:
                metrics.settlements(_RESULTS.get(result.state, "unknown")).inc()
                # A duplicate was charged when first settled: what it used.
                actual = o.prompt_tokens + o.completion_tokens
                charged = actual if result.state == 2 else result.charged
            update: dict[str, object] = {"charged_tokens": charged}
            if prices.of(o.model) is not None:  # what its tokens cost, if its model has a price
                update["cost_micros"] = _cost(prices, o)
                update["currency"] = prices.currency
            if self.batches is not None and o.pod and o.endpoint in wire.GENERATION_PATHS:
                # On its pod from when flow control let it go (Envoy's clock starts before).
                start = o.ts.timestamp()
                update["gpu_seconds"] = self.batches.gpu_seconds(
                    o.pod, start + (o.queue_ms or 0.0) / 1000, start + o.duration_ms / 1000
                )
            record = o.model_copy(update=update)
            records.append(record)
            _count(record)
        if self.sink is not None:
            self.sink.submit(records)


def _count(o: Outcome) -> None:
    metrics.served(o)  # before the labels: the first answer for a model counts under it
    labels = (o.tenant, o.model)
    metrics.requests(*labels, o.outcome).inc()
    for kind, n in (
        ("prompt", o.prompt_tokens),
        ("completion", o.completion_tokens),
        ("cached", o.cached_tokens),
        ("charged", o.charged_tokens),
    ):
        if n:
            metrics.tokens(*labels, kind).inc(n)
    if o.cost_micros:
        metrics.cost(*labels, o.currency).inc(o.cost_micros)
    if o.ttft_ms is not None:
        metrics.ttft(*labels).observe(o.ttft_ms / 1000)
    metrics.duration(*labels).observe(o.duration_ms / 1000)


def _cost(prices: Prices, o: Outcome) -> int:
    """What an outcome's tokens cost in micro-units (0: its model has no price)."""
    price = prices.of(o.model)
    if price is None:
        return 0
    return price.cost_micros(o.prompt_tokens, o.cached_tokens, o.completion_tokens)
