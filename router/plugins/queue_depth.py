"""Scorer: shorter waiting queues score higher, min-max normalised over the candidates."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from router.plugins.base import PluginError
from router.types import Candidate, PickRequest

TYPE = "queue-depth"


class QueueDepth:
    def __init__(self, name: str) -> None:
        self.name = name

    def score(self, req: PickRequest, cands: list[Candidate]) -> Sequence[float]:
        queues = [c.queue for c in cands]
        low, high = min(queues), max(queues)
        if high == low:
            return [1.0] * len(cands)
        span = high - low
        return [(high - q) / span for q in queues]


def factory(name: str, params: Mapping[str, Any]) -> QueueDepth:
    if params:
        raise PluginError(f"plugin {name!r}: takes no params")
    return QueueDepth(name)
