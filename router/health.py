"""Pod health from the replies the router sees (the outcome feed: router/collectors/outcomes.py).

A pod that answers `error_threshold` requests in a row with 5xx is out for `error_cooldown`
seconds, doubled each time it fails again before answering well, up to 16x. After a cooldown it
is on probation: one pick at a time until a pick answers well. Replies come late, batched, after
the fact: the replies to picks made before a pod was taken out are one incident, not many.
"""

from __future__ import annotations

from router.types import PodId

MAX_COOLDOWN_DOUBLINGS = 4


class Health:
    def __init__(self, error_threshold: int, error_cooldown: float) -> None:
        self.error_threshold = error_threshold
        self.error_cooldown = error_cooldown
        self._errors: dict[PodId, int] = {}
        self._trips: dict[PodId, int] = {}  # times taken out since the pod last answered well
        self._down_until: dict[PodId, float] = {}
        self._probed_at: dict[PodId, float] = {}  # last pick of a pod on probation

    def usable(self, pod: PodId, now: float, in_flight: int) -> bool:
        """Not in a cooldown; and after one, on probation: one pick at a time until a pick
        answers well (without this, every pick made while the probe's answer is on its way
        would go to a pod that may still be failing)."""
        if self._down_until.get(pod, 0.0) > now:
            return False
        if not self._trips.get(pod) or in_flight == 0:
            return True
        # A probe whose outcome is lost must not keep the pod out: one more per base cooldown.
        return now - self._probed_at.get(pod, float("-inf")) >= self.error_cooldown

    def picked(self, pod: PodId, now: float) -> None:
        """A pick of the pod counted in flight: on probation, its probe."""
        if self._trips.get(pod):
            self._probed_at[pod] = now

    def report(self, pod: PodId, status: int, now: float) -> None:
        """A reply of the pod: consecutive 5xx take it out for a while."""
        if status < 500:
            self._errors[pod] = 0
            self._trips[pod] = 0
            return
        if now < self._down_until.get(pod, float("-inf")):
            # Already out: these are picks made before it was taken out, not new evidence.
            # They must not lengthen its penalty.
            return
        self._errors[pod] = self._errors.get(pod, 0) + 1
        on_probation = self._trips.get(pod, 0) > 0  # one failed probe is enough
        if on_probation or self._errors[pod] >= self.error_threshold:
            trips = self._trips.get(pod, 0)
            cooldown = self.error_cooldown * 2 ** min(trips, MAX_COOLDOWN_DOUBLINGS)
            self._down_until[pod] = now + cooldown
            self._trips[pod] = trips + 1
            self._errors[pod] = 0

    def forget(self, pod: PodId) -> None:
        for table in (self._errors, self._trips, self._down_until, self._probed_at):
            table.pop(pod, None)
