"""Scorer: free KV cache (1 - usage); stale pods score 0."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from router.plugins.base import PluginError
from router.types import Candidate, PickRequest

TYPE = "kv-headroom"


class KvHeadroom:
    def __init__(self, name: str) -> None:
        self.name = name

    def score(self, req: PickRequest, cands: list[Candidate]) -> Sequence[float]:
        return [1.0 - c.kv for c in cands]


def factory(name: str, params: Mapping[str, Any]) -> KvHeadroom:
    if params:
        raise PluginError(f"plugin {name!r}: takes no params")
    return KvHeadroom(name)
