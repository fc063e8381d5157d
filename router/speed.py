"""Each pod's decode speed relative to the fastest pod, from its inter-token latency histogram.

Per pod, the scrapes' deltas of `vllm:inter_token_latency_seconds` sum and count are decayed with
half-life `half_life_s` (a recent mean ITL); a pod's speed is the fastest pod's mean over its own,
in steps of `step`, and it changes only when the estimate is a whole step away from it: the
rendezvous homes weighted by it (plugins/session_affinity.py) move, and their prompts' KV with
them, only when the pod really got slower or faster. A pod with fewer than `min_tokens` recent
tokens, or without the histogram, is at full speed.

Why ITL and not TTFT: TTFT mixes queueing and prefix-cache hits, ITL is one engine step. It
still grows with batch and with the prefill chunks a pod runs between decodes, so a pod given
more than its share looks slower and gets less: when each pod's work is proportional to its
speed (equal batches, equal prefill share) the ITL ratio is the speed ratio, and that split is
where this estimate settles.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from router.types import PodId, PodMetrics


@dataclass(slots=True)
class _Pod:
    at: float
    seconds: float  # cumulative, as last scraped
    count: float
    recent_seconds: float = 0.0  # decayed sums of the deltas
    recent_count: float = 0.0


class Speeds:
    def __init__(
        self, half_life_s: float = 10.0, min_tokens: float = 50.0, step: float = 0.1
    ) -> None:
        self.half_life_s = half_life_s
        self.min_tokens = min_tokens
        self.step = step
        self._pods: dict[PodId, _Pod] = {}
        self._current: dict[PodId, float] = {}
        # Recomputed when read after a change, not at each scrape: every pod's scrape would
        # otherwise cost a pass over every pod (quadratic in the fleet's size).
        self._stale = False
        # Told the speeds that moved when they are recomputed (1 for a pod left out now).
        self.changed: Callable[[dict[PodId, float]], None] | None = None

    @property
    def current(self) -> dict[PodId, float]:
        """Each pod's speed; pods left out run at 1."""
        if self._stale:
            self._stale = False
            old, new = self._current, self._speeds()
            self._current = new
            if self.changed is not None:
                moved = {pod: v for pod, v in new.items() if old.get(pod) != v}
                self.changed(dict.fromkeys(old.keys() - new.keys(), 1.0) | moved)
        return self._current

    @current.setter
    def current(self, speeds: dict[PodId, float]) -> None:  # (as a test sets them)
        self._current, self._stale = speeds, False

    def observe(self, metrics: PodMetrics) -> None:
        seconds, count = metrics.itl_seconds, metrics.itl_count
        if seconds is None or count is None:
            return
        p = self._pods.get(metrics.pod)
        if p is None or count < p.count:  # new, or restarted: its counters went back
            self._pods[metrics.pod] = _Pod(metrics.at, seconds, count)
            return
        decay = 0.5 ** ((metrics.at - p.at) / self.half_life_s)
        p.recent_seconds = p.recent_seconds * decay + seconds - p.seconds
        p.recent_count = p.recent_count * decay + count - p.count
        p.at, p.seconds, p.count = metrics.at, seconds, count
        self._stale = True

    def forget(self, pod: PodId) -> None:
        self._pods.pop(pod, None)
        self._stale = True

    def _speeds(self) -> dict[PodId, float]:
        means = {
            pod: p.recent_seconds / p.recent_count
            for pod, p in self._pods.items()
            if p.recent_count >= self.min_tokens and p.recent_seconds > 0
        }
        if not means:
            return {}
        fastest = min(means.values())
        step = self.step
        speeds = {}
        for pod, mean in means.items():
            raw = fastest / mean
            was = self._current.get(pod)
            keep = was is not None and abs(raw - was) < step
            speeds[pod] = was if keep and was is not None else max(step, round(raw / step) * step)
        return speeds
