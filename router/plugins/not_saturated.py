"""Filter: pods below the saturation bounds, unless every pod is saturated (then all stay).

Stale metrics count as saturated.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmgw.config import Strict
from router.plugins.base import parse_params
from router.types import Candidate, PickRequest

TYPE = "not-saturated"


class Params(Strict):
    kv_max: float = 0.95  # KV-cache usage at or above this is saturated
    queue_max: float = 8.0  # waiting requests at or above this is saturated


class NotSaturated:
    def __init__(self, name: str, params: Params) -> None:
        self.name = name
        self.kv_max = params.kv_max
        self.queue_max = params.queue_max

    def filter(self, req: PickRequest, cands: list[Candidate]) -> list[Candidate]:
        kept = [c for c in cands if c.fresh and c.kv < self.kv_max and c.queue < self.queue_max]
        return kept or cands


def factory(name: str, params: Mapping[str, Any]) -> NotSaturated:
    return NotSaturated(name, parse_params(Params, name, params))
