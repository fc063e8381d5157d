"""Whose fault a pod's failure is, for the tenant breakers: the pod's when it failed many tenants
at once. A pod whose engine died answers 500 to everyone; a pod killed resets every stream it
held (those carry Envoy's flags, llmgw/breaker.py FLEET_FLAGS, and are the fleet's anyway).

The rule: a failure (an `upstream_error` with a pod) is the pod's when, within `window_s` of
its arrival, the same pod failed at least `tenants` different tenants, this one included. A
batch's failures are all counted before any of them is judged, so a storm that arrives in one
flush of Envoy's access log (about a second) is the pod's from its first outcome; one spread
over several flushes counts against the first tenants until the others show (below the
thresholds: one failure never trips).

Each ledger replica sees the outcomes of the Envoys streaming to it: with several replicas the
tenants must be seen by one of them. Pure, on a given clock."""

from __future__ import annotations

import collections
from collections.abc import Sequence

from pydantic import Field

from llmgw.config import Strict
from llmgw.outcome import Outcome


class BlameSettings(Strict):
    # Three tenants: two is what one misbehaving pair of tenants can do to a pod together.
    tenants: int = Field(default=3, ge=2)
    # Ten seconds: Envoy ejects a pod failing every request within seconds (outlier detection),
    # and its access log arrives in flushes about a second apart.
    window_s: float = Field(default=10.0, gt=0)


def _failed(o: Outcome) -> bool:
    return bool(o.pod) and bool(o.tenant) and o.outcome == "upstream_error"


class Blame:
    def __init__(self, settings: BlameSettings) -> None:
        self.settings = settings
        # Per pod, each tenant it failed and when it last did.
        self._failed: dict[str, dict[str, float]] = collections.defaultdict(dict)

    def judge(self, now: float, batch: Sequence[Outcome]) -> list[bool]:
        """For each outcome of the batch, whether it is a failure that is its pod's."""
        for o in batch:
            if _failed(o):
                self._failed[o.pod][o.tenant] = now
        self._forget(now - self.settings.window_s)
        many = {
            pod for pod, tenants in self._failed.items() if len(tenants) >= self.settings.tenants
        }
        return [_failed(o) and o.pod in many for o in batch]

    def _forget(self, before: float) -> None:
        for pod in list(self._failed):
            tenants = self._failed[pod]
            for tenant in [t for t, at in tenants.items() if at < before]:
                del tenants[tenant]
            if not tenants:
                del self._failed[pod]
