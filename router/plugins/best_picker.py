"""Picker: the best-scoring pod, exploring a little among near-equal ones.

Pods within `epsilon` of the best score are ties; up to `max_ties` of them (the best first) are
eligible, and one is chosen at random. A stale view therefore spreads a burst over at most
`max_ties` pods instead of sending it all to one, and never picks a clearly worse pod. The answer
is the chosen pod, then the rest by score, `max_endpoints` in all (Envoy retries down the list).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Mapping
from typing import Any

from pydantic import Field

from llmgw.config import Strict
from router.plugins.base import parse_params
from router.types import Candidate

TYPE = "best-with-exploration"


class Params(Strict):
    epsilon: float = Field(default=0.02, ge=0)
    max_ties: int = Field(default=3, ge=1)
    max_endpoints: int = Field(default=3, ge=1)
    seed: int | None = None


class BestWithExploration:
    def __init__(self, name: str, params: Params) -> None:
        self.name = name
        self.p = params
        self.rng = random.Random(params.seed)

    def pick(self, cands: list[Candidate], scores: list[float]) -> tuple[list[Candidate], bool]:
        p = self.p
        n = max(p.max_ties, p.max_endpoints)
        top = heapq.nlargest(n, range(len(cands)), key=scores.__getitem__)
        floor = scores[top[0]] - p.epsilon
        ties = [i for i in top[: p.max_ties] if scores[i] >= floor]
        chosen = self.rng.choice(ties) if len(ties) > 1 else top[0]
        order = [chosen] + [i for i in top if i != chosen]
        return [cands[i] for i in order[: p.max_endpoints]], chosen != top[0]


def factory(name: str, params: Mapping[str, Any]) -> BestWithExploration:
    return BestWithExploration(name, parse_params(Params, name, params))
