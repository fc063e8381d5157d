"""Scorer: high-priority tenants go to the least-loaded pods, low-priority ones fill busy pods.

Priority is extauthz's 1-10 (10 highest); a request without one counts as `default`. Tenants
between `low` and `high` get a neutral 0.5 everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import Field, model_validator

from llmgw.config import Strict
from router.plugins.base import parse_params
from router.types import Candidate, PickRequest

TYPE = "tenant-priority"


class Params(Strict):
    high: int = Field(default=8, ge=1, le=10)  # at or above: least loaded
    low: int = Field(default=3, ge=1, le=10)  # at or below: fill
    default: int = Field(default=5, ge=1, le=10)

    @model_validator(mode="after")
    def _ordered(self) -> Params:
        if self.low >= self.high:
            raise ValueError("low must be below high")
        return self


class TenantPriority:
    def __init__(self, name: str, params: Params) -> None:
        self.name = name
        self.p = params

    def score(self, req: PickRequest, cands: list[Candidate]) -> Sequence[float]:
        prio = self.p.default if req.priority is None else req.priority
        if prio >= self.p.high:
            return [1.0 - min(1.0, c.load) for c in cands]
        if prio <= self.p.low:
            return [min(1.0, c.load) for c in cands]
        return [0.5] * len(cands)


def factory(name: str, params: Mapping[str, Any]) -> TenantPriority:
    return TenantPriority(name, parse_params(Params, name, params))
