"""The pick: filters, then weighted scorers, then the picker; pure over a list of candidates.

The engine enforces the plugin contracts: it clamps scores to [0, 1], times every plugin (a metric
per plugin, in one pick of TIMED_EVERY: a dozen histogram observations were a third of a pick) and
reports which stage left no pod, in which case the answer is None and Envoy's fallback policy
picks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from router import metrics
from router.plugins.base import Observer
from router.registry import Profile
from router.types import Candidate, Pick, PickRequest

TIMED_EVERY = 16


@dataclass(frozen=True, slots=True)
class NoPod:
    """No candidate survived `stage` (a filter's name, or "fleet" when no pod is known)."""

    stage: str


class Engine:
    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self._observers = [
            p
            for p in (*profile.filters, *(s for s, _ in profile.scorers), profile.picker)
            if isinstance(p, Observer)
        ]
        timers = metrics.PLUGIN_SECONDS
        self._filters = [(f, timers.labels(f.name)) for f in profile.filters]
        self._scorers = [(s, w, timers.labels(s.name)) for s, w in profile.scorers if w > 0]
        self._picker_timer = timers.labels(profile.picker.name)
        self._picks = 0

    def pick(self, req: PickRequest, cands: list[Candidate], observe: bool = True) -> Pick | NoPod:
        """The pick; with `observe`, the observers learn it now (else: `observe` later)."""
        clock = time.perf_counter
        started = clock()
        if not cands:
            return self._none("fleet")
        timed = self._picks % TIMED_EVERY == 0
        self._picks += 1
        for flt, timer in self._filters:
            t0 = clock() if timed else 0.0
            cands = flt.filter(req, cands)
            if timed:
                timer.observe(clock() - t0)
            if not cands:
                return self._none(flt.name)
        totals = [0.0] * len(cands)
        for scorer, weight, timer in self._scorers:
            t0 = clock() if timed else 0.0
            scores = scorer.score(req, cands)
            if timed:
                timer.observe(clock() - t0)
            totals = [
                t + weight * (0.0 if s < 0.0 else 1.0 if s > 1.0 else s)
                for t, s in zip(totals, scores, strict=True)
            ]
        t0 = clock() if timed else 0.0
        ordered, explored = self.profile.picker.pick(cands, totals)
        if timed:
            self._picker_timer.observe(clock() - t0)
        if observe:
            self.observe(req, ordered[0])
        metrics.PICK_SECONDS.observe(clock() - started)
        return Pick(tuple(c.pod for c in ordered), "explore" if explored else "best")

    def observe(self, req: PickRequest, chosen: Candidate) -> None:
        """The plugins that learn from picks (the prefix index) learn that `chosen` got `req`."""
        for observer in self._observers:
            observer.observe(req, chosen)

    @staticmethod
    def _none(stage: str) -> NoPod:
        metrics.NO_POD.labels(stage).inc()
        return NoPod(stage)
