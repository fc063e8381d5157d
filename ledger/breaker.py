"""The tenant breaker's input: each batch's outcomes, one script per tenant (ledger/breaker.lua,
the rule of llmgw/breaker.lua before it), written in the settlement's round trip
(ledger/recorder.py). What the scripts report, trips and recoveries, becomes metrics, rows of
`ledger_events` (`llmgw usage --events`) and, for a tier with `alert`, the support hook.

What the tenant did not cause weighs nothing (llmgw/breaker.py: the fleet's flags; ledger/blame.py:
a pod that failed many tenants at once); counted in `llmgw_breaker_excused_total`.

A batch that fails is fed again with its retry: outcomes whose first feed reached Redis count
twice then (the strict side). A recovery is reported by the first feed after it, at the time it
happened (the end of the last step), so one whose tenant sends nothing more is never reported.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import resources
from typing import Any, Literal, Protocol

from ledger import metrics
from ledger.blame import Blame, BlameSettings
from llmgw.breaker import EXCUSED, BreakerSpec, with_prelude
from llmgw.outcome import Outcome
from llmgw.resp import Arg, Client, RespError, evalsha_each
from llmgw.tiers import TierTable
from llmgw.wire import breaker_key

log = logging.getLogger("ledger.breaker")

SOURCE = with_prelude(resources.files("ledger").joinpath("breaker.lua").read_text())
SHA = hashlib.sha1(SOURCE.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Transition:
    kind: Literal["trip", "recover"]
    tenant: str
    tier: str
    at_ms: int  # Redis's time of the trip, or the end of the last recovery step
    first_ms: int  # the episode's first trip
    cause: str = ""  # trip: the status (or "stream") of the outcome that tripped it
    cooldown_ms: int = 0  # trip: how long it stays open
    reopen: bool = False  # trip: a failure during recovery

    def detail(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tier": self.tier, "first_trip": _time(self.first_ms).isoformat()}
        if self.kind == "trip":
            out |= {"cause": self.cause, "cooldown_s": self.cooldown_ms / 1000}
            out["reopen"] = self.reopen
        else:
            out["recovered_after_s"] = (self.at_ms - self.first_ms) / 1000
        return out


class Events(Protocol):
    def submit_event(
        self,
        kind: str,
        tenant: str = "",
        detail: Mapping[str, Any] | None = None,
        ts: datetime | None = None,
    ) -> None: ...


class Alert(Protocol):
    """ledger/alerts.py's `Alerts.emit`."""

    def __call__(
        self,
        kind: Literal["platinum_breaker_open"],
        *,
        tenant: str = "",
        tier: str = "",
        detail: Mapping[str, Any] | None = None,
    ) -> object: ...


class Breakers:
    def __init__(
        self,
        tiers: Callable[[], TierTable],
        events: Events | None,
        alert: Alert | None,
        blame: Blame | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tiers = tiers  # the tier table as it is now (it reloads)
        self.events = events
        self.alert = alert
        self.blame = blame or Blame(BlameSettings())
        self.clock = clock

    async def feed(self, client: Client, batch: Sequence[Outcome]) -> list[Transition]:
        """Feed the batch (every script written before any reply is awaited); raises
        ConnectionError, TimeoutError or RespError when Redis fails."""
        table = self.tiers()
        calls: dict[str, tuple[str, BreakerSpec, list[Arg]]] = {}
        pods_fault = self.blame.judge(self.clock(), batch)
        for o, pods in zip(batch, pods_fault, strict=True):
            spec = table.tier(o.tier).breaker if o.tenant else None
            if spec is None:
                continue
            entry = calls.get(o.tenant)
            if entry is None:
                entry = calls[o.tenant] = (o.tier, spec, [*spec.feed_args()])
            weighed = spec.weight(o, pods)
            if weighed.cause in EXCUSED:
                metrics.BREAKER_EXCUSED.labels(weighed.cause).inc()
            entry[2].extend((repr(weighed.weight), weighed.score, weighed.cause))
        tenants = list(calls)
        scripts = [(1, breaker_key(t), *calls[t][2]) for t in tenants]
        replies = await evalsha_each(client, SOURCE, SHA, scripts)
        out: list[Transition] = []
        for tenant, reply in zip(tenants, replies, strict=True):
            if isinstance(reply, BaseException):
                raise reply
            if not isinstance(reply, list) or not reply:
                raise RespError(f"breaker.lua returned {reply!r}")
            out += [_transition(tenant, calls[tenant][0], r) for r in reply[1:]]
        return out

    def record(self, transitions: Sequence[Transition]) -> None:
        """Metrics, ledger events and alerts of what the feed reported."""
        for t in transitions:
            detail = t.detail()
            if t.kind == "trip":
                metrics.breaker_trips(t.tenant, t.tier, t.cause, str(t.reopen).lower()).inc()
                metrics.BREAKER_OPEN_SECONDS.labels(t.tier).observe(t.cooldown_ms / 1000)
                spec = self.tiers().tier(t.tier).breaker
                if self.alert is not None and spec is not None and spec.alert:
                    self.alert("platinum_breaker_open", tenant=t.tenant, tier=t.tier, detail=detail)
            else:
                took = (t.at_ms - t.first_ms) / 1000
                metrics.BREAKER_RECOVERY_SECONDS.labels(t.tier).observe(took)
            log.warning(f"breaker {t.kind}", extra={"tenant": t.tenant, "breaker": detail})
            if self.events is not None:
                self.events.submit_event(f"breaker.{t.kind}", t.tenant, detail, _time(t.at_ms))


def _transition(tenant: str, tier: str, raw: object) -> Transition:
    fields = raw.decode().split() if isinstance(raw, bytes) else []
    match fields:
        case ["trip", at, cause, cooldown, reopen, first]:
            return Transition(
                "trip", tenant, tier, int(at), int(first), cause, int(cooldown), reopen == "1"
            )
        case ["recover", at, first]:
            return Transition("recover", tenant, tier, int(at), int(first))
    raise RespError(f"breaker.lua reported {raw!r}")


def _time(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)
