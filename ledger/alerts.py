"""API: `alerts.emit("platinum_breaker_open", tenant=t, tier="platinum", detail={...})` → `Alert`.

Every alert, whether a detector found it (ledger/detectors.py, evaluated every `interval_s` on
the outcomes the recorder hands over) or another part of the ledger emitted it (the tenant
breaker), becomes a structured log line, `llmgw_ledger_alerts_total{kind}`, an `alert.<kind>`
row in `ledger_events` (its detail: the webhook body) and a delivery to each webhook configured
for its kind (ledger/webhooks.py). `emit()` never blocks and never raises: nothing here is on the
request path, and an alert must not stop the ledger.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal, Protocol

from ledger import metrics
from ledger.detectors import DetectorKind, Detectors, Gap
from llmgw.outcome import Outcome

log = logging.getLogger("ledger.alerts")

AlertKind = Literal[DetectorKind, "platinum_breaker_open", "spend_threshold"]


@dataclass(frozen=True)
class Alert:
    id: str  # unique per alert, the same in every delivery: the receiver's idempotency key
    kind: AlertKind
    ts: datetime
    tenant: str = ""
    tier: str = ""
    detail: Mapping[str, Any] = field(default_factory=dict)

    def payload(self) -> dict[str, Any]:
        """The webhook body as a dict: {id, kind, ts, tenant?, tier?, detail}."""
        out: dict[str, Any] = {"id": self.id, "kind": self.kind, "ts": self.ts.isoformat()}
        out.update({k: v for k, v in (("tenant", self.tenant), ("tier", self.tier)) if v})
        out["detail"] = dict(self.detail)
        return out

    def body(self) -> bytes:
        return json.dumps(self.payload(), separators=(",", ":"), default=str).encode()


class Events(Protocol):
    def submit_event(
        self, kind: str, tenant: str = "", detail: Mapping[str, Any] | None = None
    ) -> None: ...


class Sender(Protocol):
    def send(self, alert: Alert) -> None: ...


class Alerts:
    """The recorder's watch (`observe`, `unchecked`), `emit()` for anyone, and the loop that
    evaluates the detectors: `start()`, then `await close()`."""

    def __init__(
        self,
        detectors: Detectors,
        events: Events | None,
        sender: Sender | None,
        *,
        backlog: Callable[[], Mapping[str, int]],
        gap: Callable[[], Gap] = Gap,
        interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.detectors = detectors
        self.events = events
        self.sender = sender
        self.backlog = backlog
        self.gap = gap
        self.interval_s = interval_s
        self.clock = clock
        self._task: asyncio.Task[None] | None = None

    def observe(self, outcomes: Sequence[Outcome]) -> None:
        self.detectors.observe(self.clock(), outcomes)

    def unchecked(self, outcome: Outcome) -> None:
        self.detectors.unchecked(self.clock(), outcome)

    def evaluate(self) -> list[Alert]:
        """Emit what the detectors find now."""
        found = self.detectors.evaluate(self.clock(), self.backlog(), self.gap())
        return [self.emit(f.kind, tenant=f.tenant, tier=f.tier, detail=f.detail) for f in found]

    def emit(
        self,
        kind: AlertKind,
        *,
        tenant: str = "",
        tier: str = "",
        detail: Mapping[str, Any] | None = None,
    ) -> Alert:
        alert = Alert(uuid.uuid4().hex, kind, datetime.now(UTC), tenant, tier, dict(detail or {}))
        metrics.ALERTS.labels(kind).inc()
        log.warning(
            "alert",
            extra={
                "alert": kind,
                "alert_id": alert.id,
                "tenant": tenant,
                "tier": tier,
                "detail": alert.detail,  # nested: its keys cannot clash with the record's
            },
        )
        if self.events is not None:
            self.events.submit_event(f"alert.{kind}", tenant, alert.payload())
        if self.sender is not None:
            self.sender.send(alert)
        return alert

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.evaluate()
            except Exception:  # a rule's bug must not end the loop (nor the ledger)
                log.exception("alert evaluation failed")

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="ledger-alerts")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
