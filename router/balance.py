"""When affinity must yield: SGLang-style imbalance thresholds on the router's load view."""

from __future__ import annotations

from llmgw.config import Strict
from router.types import Candidate


class Imbalance(Strict):
    """Affinity to a pod yields when the pod is at capacity, or when its load exceeds the least
    loaded candidate's by more than `abs_threshold` (fraction of capacity) and by a factor of more
    than `rel_threshold`."""

    abs_threshold: float = 0.5  # load counts running and in flight: one request twice
    rel_threshold: float = 1.5

    def yields(self, target: Candidate, cands: list[Candidate]) -> bool:
        if target.load >= 1.0:
            return True
        least = min(c.load for c in cands)
        gap = target.load - least
        return gap > self.abs_threshold and target.load > least * self.rel_threshold
