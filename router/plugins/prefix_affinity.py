"""Scorer: pods that recently served the longest part of this prompt's prefix score higher.

Score = leading blocks the pod holds / blocks in the prompt. Each pod's memory of blocks is an LRU
as large as its KV cache (from `vllm:cache_config_info`, else `default_capacity_blocks`).
Yields (all zeros) when the best-matching pod is overloaded per the imbalance thresholds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import Field

from llmgw.config import Strict
from llmgw.facts import BLOCK_TOKENS
from router.balance import Imbalance
from router.plugins.base import parse_params
from router.prefix import PrefixIndex
from router.types import Candidate, PickRequest

TYPE = "prefix-affinity"


class Params(Strict):
    default_capacity_blocks: int = Field(default=8192, ge=1)
    imbalance: Imbalance = Imbalance()


class PrefixAffinity:
    def __init__(self, name: str, params: Params) -> None:
        self.name = name
        self.p = params
        self.index = PrefixIndex()

    def score(self, req: PickRequest, cands: list[Candidate]) -> Sequence[float]:
        blocks = req.prefix_blocks
        if not blocks:
            return [0.0] * len(cands)
        depth = self.index.match(blocks)
        if not depth:
            return [0.0] * len(cands)
        scores = [depth.get(c.pod, 0) / len(blocks) for c in cands]
        best = max(range(len(cands)), key=scores.__getitem__)
        if self.p.imbalance.yields(cands[best], cands):
            return [0.0] * len(cands)
        return scores

    def observe(self, req: PickRequest, chosen: Candidate) -> None:
        if not req.prefix_blocks:
            return
        kv_tokens = chosen.metrics.kv_tokens
        capacity = (
            kv_tokens // BLOCK_TOKENS if kv_tokens is not None else self.p.default_capacity_blocks
        )
        self.index.record(chosen.pod, req.prefix_blocks, capacity)


def factory(name: str, params: Mapping[str, Any]) -> PrefixAffinity:
    return PrefixAffinity(name, parse_params(Params, name, params))
