"""Alert webhooks: signed POSTs to the configured URLs only, retried with backoff, one bounded
queue and one worker per receiver (a slow or dead receiver delays only its own alerts).

Each POST carries the alert's JSON body (ledger/alerts.py) and three headers:
    X-Llmgw-Alert-Id:  the alert's id, the same in every attempt: the receiver's idempotency key
    X-Llmgw-Timestamp: Unix seconds when this attempt was signed
    X-Llmgw-Signature: v1=<hex HMAC-SHA256(secret, timestamp + "." + body)>
Delivery is at least once (an attempt whose answer is lost is sent again), so a receiver that
dedupes by the id sees each alert once. A full queue drops its oldest delivery: the newest
alerts describe the fleet as it is now, and every alert is in `ledger_events` anyway.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import logging
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp

from ledger import metrics
from ledger.alerts import Alert, AlertKind
from llmgw.serve import finish

log = logging.getLogger("ledger.webhooks")

ID_HEADER = "X-Llmgw-Alert-Id"
TIMESTAMP_HEADER = "X-Llmgw-Timestamp"
SIGNATURE_HEADER = "X-Llmgw-Signature"
RETRIED_STATUSES = frozenset({408, 425, 429})  # and every 5xx


def sign(secret: bytes, timestamp: str, body: bytes) -> str:
    return "v1=" + hmac.new(secret, timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Hook:
    url: str
    secret: bytes = field(repr=False)

    @property
    def host(self) -> str:
        """What a log line may name: the URL's path or query may hold a token (Slack's do)."""
        parts = urlsplit(self.url)
        return f"{parts.hostname}:{parts.port}" if parts.port else str(parts.hostname)


@dataclass(frozen=True)
class _Delivery:
    alert: Alert
    body: bytes


@dataclass
class _Receiver:
    hook: Hook
    queue: collections.deque[_Delivery] = field(default_factory=collections.deque)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    inflight: _Delivery | None = None
    task: asyncio.Task[None] | None = None


class Webhooks:
    """`send()` from anywhere on the loop (never blocks); `start()`, then `await close()`."""

    def __init__(
        self,
        hooks: Mapping[AlertKind, Sequence[Hook]],
        *,
        queue_max: int = 1000,
        attempts: int = 6,
        backoff_s: float = 0.5,
        backoff_max_s: float = 30.0,
        timeout_s: float = 5.0,
    ) -> None:
        self.queue_max = queue_max
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.timeout_s = timeout_s
        receivers: dict[Hook, _Receiver] = {}
        self._routes = {
            kind: [receivers.setdefault(h, _Receiver(h)) for h in kind_hooks]
            for kind, kind_hooks in hooks.items()
        }
        self._receivers = list(receivers.values())
        self._session: aiohttp.ClientSession | None = None
        self._closing = False
        metrics.ALERT_QUEUE.set_function(
            lambda: sum(len(r.queue) + (r.inflight is not None) for r in self._receivers)
        )

    def send(self, alert: Alert) -> None:
        routes = self._routes.get(alert.kind, ())
        if not routes:
            return
        delivery = _Delivery(alert, alert.body())  # one body: every attempt signs the same bytes
        for r in routes:
            if self._closing:
                metrics.DELIVERIES.labels(alert.kind, "dropped").inc()
                continue
            if len(r.queue) >= self.queue_max:
                metrics.DELIVERIES.labels(r.queue.popleft().alert.kind, "dropped").inc()
            r.queue.append(delivery)
            r.wake.set()

    def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        for r in self._receivers:
            r.task = asyncio.create_task(self._work(r), name=f"webhook-{r.hook.host}")

    async def close(self, drain_s: float) -> None:
        """Deliver what is queued for up to `drain_s`; the rest is counted dropped."""
        self._closing = True
        for r in self._receivers:
            r.wake.set()
        running = [r.task for r in self._receivers if r.task is not None and not r.task.done()]
        await asyncio.gather(*(finish(task, drain_s) for task in running))
        for r in self._receivers:
            left = [*r.queue, *([r.inflight] if r.inflight else [])]
            r.queue.clear()
            r.inflight = None
            for d in left:
                metrics.DELIVERIES.labels(d.alert.kind, "dropped").inc()
        if self._session is not None:
            await self._session.close()

    async def _work(self, r: _Receiver) -> None:
        while True:
            if not r.queue:
                if self._closing:
                    return
                r.wake.clear()
                await r.wake.wait()
                continue
            r.inflight = r.queue.popleft()
            await self._deliver(r.hook, r.inflight)
            r.inflight = None

    async def _deliver(self, hook: Hook, d: _Delivery) -> None:
        kind, alert_id = d.alert.kind, d.alert.id
        for attempt in range(1, self.attempts + 1):
            result = await self._post(hook, d)
            if result == "retry" and attempt < self.attempts:
                metrics.DELIVERIES.labels(kind, "retried").inc()
                delay = min(self.backoff_max_s, self.backoff_s * 2 ** (attempt - 1))
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))
                continue
            if result == "retry":
                result = "failed"
            metrics.DELIVERIES.labels(kind, result).inc()
            if result != "delivered":
                log.warning(
                    "alert not delivered",
                    extra={
                        "alert": kind,
                        "alert_id": alert_id,
                        "hook": hook.host,
                        "result": result,
                    },
                )
            return

    async def _post(self, hook: Hook, d: _Delivery) -> str:
        """delivered, rejected (not worth retrying) or retry."""
        assert self._session is not None, "start() first"
        timestamp = str(int(time.time()))
        headers = {
            "Content-Type": "application/json",
            ID_HEADER: d.alert.id,
            TIMESTAMP_HEADER: timestamp,
            SIGNATURE_HEADER: sign(hook.secret, timestamp, d.body),
        }
        try:
            # Only the configured URL: a redirect is an answer, not a new destination.
            async with self._session.post(
                hook.url, data=d.body, headers=headers, allow_redirects=False
            ) as resp:
                status = resp.status
        except (aiohttp.ClientError, TimeoutError):
            return "retry"
        if 200 <= status < 300:
            return "delivered"
        return "retry" if status >= 500 or status in RETRIED_STATUSES else "rejected"
