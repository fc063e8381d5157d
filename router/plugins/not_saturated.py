"""Filter: pods below the saturation bounds, unless every pod is saturated (then all stay).

Stale metrics count as saturated.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from router.plugins.base import parse_params
from router.saturation import Bounds
from router.types import Candidate, PickRequest

TYPE = "not-saturated"


class NotSaturated:
    def __init__(self, name: str, bounds: Bounds) -> None:
        self.name = name
        self.bounds = bounds  # flow control's too (router/saturation.py)

    def filter(self, req: PickRequest, cands: list[Candidate]) -> list[Candidate]:
        saturated = self.bounds.saturated
        kept = [c for c in cands if not saturated(c)]
        return kept or cands


def factory(name: str, params: Mapping[str, Any]) -> NotSaturated:
    return NotSaturated(name, parse_params(Bounds, name, params))
