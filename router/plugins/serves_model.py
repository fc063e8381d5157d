"""Filter: pods that serve the requested model (pods whose model list is not known yet stay)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from router.plugins.base import PluginError
from router.types import Candidate, PickRequest

TYPE = "serves-model"


class ServesModel:
    def __init__(self, name: str) -> None:
        self.name = name

    def filter(self, req: PickRequest, cands: list[Candidate]) -> list[Candidate]:
        model = req.model
        if model is None:
            return cands
        return [c for c in cands if not c.metrics.models or model in c.metrics.models]


def factory(name: str, params: Mapping[str, Any]) -> ServesModel:
    if params:
        raise PluginError(f"plugin {name!r}: takes no params")
    return ServesModel(name)
