"""Scorer: pods that hold more of this prompt's KV score higher; a prompt no pod holds goes where
it will stay cached.

The map of what each pod holds is router/prefix.py: an LRU per pod as large as its KV cache
(from `vllm:cache_config_info`, else `default_capacity_blocks`), charged with every block of a
prompt. Score = h + (1 - h) · `placement` · r, where h is the share of the prompt's blocks the
pod holds and r how cheaply it takes the rest: 1 when they fit, else i / (i + `cold_s`) for the
idle seconds i of the warmest entry they would evict (evicting what nobody read for a minute
costs little; evicting what was read a second ago costs the next request its hit).

Where a pod publishes its KV events (router/kvindex.py) and the request carries the pods' own
block hashes, h is what the pod's events say it holds: the blocks it really has, whoever sent
them (another replica, a pod restarted). Only the leading blocks are hashed (at most
`max_blocks`): where a pod holds all of them, the map may know more of the rest (a
conversation's own turns after a long system prompt), and the larger of the two counts. Where
no pod's events show any of the prompt, the map decides alone. The map
stays for the pods that publish none, and for r: which entries a pod would evict next.

When the pod holding most of it is overloaded per the imbalance thresholds, the holders count as
holding nothing: the prompt is placed again, and a popular prefix comes to live on several pods.
"""

from __future__ import annotations

import math
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
    placement: float = Field(default=0.5, ge=0, le=1)  # the most a pod with room scores
    cold_s: float = Field(default=10.0, gt=0)  # idle seconds at which evicting costs half
    imbalance: Imbalance = Imbalance()


def prompt_blocks(req: PickRequest) -> int:
    """All of the prompt's blocks, not only the hashed ones."""
    return max(len(req.prefix_blocks), math.ceil(req.prompt_tokens / BLOCK_TOKENS))


class PrefixAffinity:
    def __init__(self, name: str, params: Params) -> None:
        self.name = name
        self.p = params
        self.index = PrefixIndex()

    def capacity(self, c: Candidate) -> int:
        tokens = c.metrics.kv_tokens
        return tokens // BLOCK_TOKENS if tokens is not None else self.p.default_capacity_blocks

    def score(self, req: PickRequest, cands: list[Candidate]) -> Sequence[float]:
        blocks = req.prefix_blocks
        if not blocks and not req.kv_blocks:
            return [0.0] * len(cands)
        total = prompt_blocks(req)
        held = self.index.held(blocks, req.session, total) if blocks else {}
        # Where no pod's events show any of it, the map decides: it may know what the events do
        # not (the pods hashing otherwise than extauthz: llmgw_router_kv_lookups_total says).
        known = any(c.kv_held for c in cands)
        have = [self._have(req, c, held.get(c.pod, 0), total, known) for c in cands]
        share = [h / total for h in have]
        best = max(range(len(cands)), key=share.__getitem__)
        if share[best] > 0 and self.p.imbalance.yields(cands[best], cands):
            share = [0.0] * len(cands)
        cold_s, placement = self.p.cold_s, self.p.placement
        scores = []
        for c, h, had in zip(cands, share, have, strict=True):
            rest = total - had
            idle = self.index.idle_evicted(c.pod, rest, self.capacity(c))
            room = 1.0 if idle == float("inf") else idle / (idle + cold_s)
            scores.append(h + (1.0 - h) * placement * room)
        return scores

    @staticmethod
    def _have(req: PickRequest, c: Candidate, mapped: int, total: int, known: bool) -> int:
        """The prompt's blocks `c` holds, in the map's blocks of BLOCK_TOKENS."""
        if c.kv_held is None or not known:
            return mapped
        counted = min(total, c.kv_held * req.kv_block_size // BLOCK_TOKENS)
        return max(counted, mapped) if c.kv_held >= len(req.kv_blocks) else counted

    def observe(self, req: PickRequest, chosen: Candidate) -> None:
        if not req.prefix_blocks:
            return
        self.index.record(
            chosen.pod, req.prefix_blocks, req.session, prompt_blocks(req), self.capacity(chosen)
        )


def factory(name: str, params: Mapping[str, Any]) -> PrefixAffinity:
    return PrefixAffinity(name, parse_params(Params, name, params))
