"""Scorer: the seed formula S = w1·max(0, M − θ) + w2·Q/C + w3·G, lower is better.

M is KV-cache usage, Q the waiting queue, C the pod's capacity, G the load
((running + in flight) / C); Q/C and G are capped at 1. The score is 1 − S / S_max.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import Field

from llmgw.config import Strict
from router.plugins.base import parse_params
from router.types import Candidate, PickRequest

TYPE = "seed-formula"


class Params(Strict):
    w1: float = Field(default=1.0, ge=0)
    w2: float = Field(default=1.0, ge=0)
    w3: float = Field(default=1.0, ge=0)
    theta: float = Field(default=0.8, ge=0, lt=1)


class SeedFormula:
    def __init__(self, name: str, params: Params) -> None:
        self.name = name
        self.p = params
        self.s_max = params.w1 * (1 - params.theta) + params.w2 + params.w3 or 1.0

    def score(self, req: PickRequest, cands: list[Candidate]) -> Sequence[float]:
        p = self.p
        return [
            1.0
            - (
                p.w1 * max(0.0, c.kv - p.theta)
                + p.w2 * min(1.0, c.queue / c.capacity)
                + p.w3 * min(1.0, c.load)
            )
            / self.s_max
            for c in cands
        ]


def factory(name: str, params: Mapping[str, Any]) -> SeedFormula:
    return SeedFormula(name, parse_params(Params, name, params))
