"""Filter: pods whose last scrape succeeded and that have not been answering with errors."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from router.plugins.base import PluginError
from router.types import Candidate, PickRequest

TYPE = "healthy"


class Healthy:
    def __init__(self, name: str) -> None:
        self.name = name

    def filter(self, req: PickRequest, cands: list[Candidate]) -> list[Candidate]:
        return [c for c in cands if c.healthy]


def factory(name: str, params: Mapping[str, Any]) -> Healthy:
    if params:
        raise PluginError(f"plugin {name!r}: takes no params")
    return Healthy(name)
