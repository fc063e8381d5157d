"""Scorer: 1 - (running + in flight) / capacity. The router's own in-flight count moves with
every pick, so a burst between two scrapes spreads instead of herding on one pod."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from router.plugins.base import PluginError
from router.types import Candidate, PickRequest

TYPE = "load"


class Load:
    def __init__(self, name: str) -> None:
        self.name = name

    def score(self, req: PickRequest, cands: list[Candidate]) -> Sequence[float]:
        return [1.0 - c.load for c in cands]


def factory(name: str, params: Mapping[str, Any]) -> Load:
    if params:
        raise PluginError(f"plugin {name!r}: takes no params")
    return Load(name)
