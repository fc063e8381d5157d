"""Scorer: keep a conversation on one pod, the same on every router replica.

The conversation's pod is derived, not stored: rendezvous (highest-random-weight) hashing over
the candidate pods of its root, the prompt's first block (the system prompt's start, or the first
message), else the session ID, with process-independent hashes. Conversations that share a system
prompt thus share a pod and its prefix cache instead of spreading every tenant's prompt over the
fleet. Two replicas with the same view of the fleet pick the same pod, with no shared state and no
Redis on the pick path; when a pod leaves, only its conversations move. The rendezvous is
weighted by each pod's speed (router/speed.py): a half-speed pod is home to about half as many
roots, so it gets about half the work.

A short first turn gets no affinity (nothing of it is cached anywhere; pinning fresh requests by
hash would be random routing): prefix affinity and load place it. A first turn of at least
`first_turn_blocks` blocks is homed like its next turns: a long prompt's start is most likely a
system prompt that other conversations also send, and placing it anywhere else would put it on
a second pod at the next turn (twice the KV for the same prompt). Loads are bounded (`bound`: a
busy pod passes the conversation to the next pod in rendezvous order), and affinity yields (all
zeros) when even that pod is overloaded per the imbalance thresholds, so affinity never makes a
hot spot.

Where the pods' own KV events say another pod holds more of the prompt than the home pod
(`kv_held`, router/kvindex.py), affinity yields: what the pods really hold places the request
(prefix affinity), whoever put it there, and every replica reads the same events.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from pydantic import Field

from llmgw.config import Strict
from router.balance import Imbalance
from router.plugins.base import parse_params
from router.plugins.prefix_affinity import prompt_blocks
from router.types import Candidate, PickRequest

TYPE = "session-affinity"
_MASK = (1 << 64) - 1


class Params(Strict):
    # Bounded loads: a pod takes a conversation only while its requests (running, waiting and
    # in flight), plus this one, stay within `bound` x the fleet mean; else the next pod in the
    # key's rendezvous order does. A hot tenant spills over its next pods, the same on every
    # replica, rather than queueing on one. Loose: a spilled request prefills its whole prompt
    # again elsewhere (a 3000-token system prompt: ~0.1 s of an H100), more than it waits
    # behind a few more decodes on its own pod.
    bound: float = Field(default=2.0, ge=1.0)
    slack: float = Field(default=4.0, ge=0.0)  # requests over the bound any pod may take
    first_turn_blocks: int = Field(default=32, ge=1)  # a first turn this long is homed too
    imbalance: Imbalance = Imbalance()


@lru_cache(maxsize=65536)
def stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def _mix(x: int) -> int:
    """splitmix64 finaliser."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def requests(c: Candidate) -> float:
    return c.load * c.capacity + c.queue


def rendezvous(key: int, c: Candidate) -> float:
    """Weighted rendezvous: pod i is first for a share speed_i / sum(speeds) of the keys."""
    u = ((_mix(key ^ stable_hash(c.pod)) >> 11) + 0.5) / 2.0**53  # in (0, 1), exactly
    return -c.speed / math.log(u)


def owner(key: int, cands: list[Candidate], bound: float, slack: float) -> int:
    """Index of the key's pod: the first in rendezvous order within the bounded load."""
    weights = [rendezvous(key, c) for c in cands]
    order = sorted(range(len(cands)), key=weights.__getitem__, reverse=True)
    loads = [requests(c) for c in cands]
    allowed = bound * (sum(loads) + 1) / len(cands) + slack
    return next((i for i in order if loads[i] + 1 <= allowed), order[0])


class SessionAffinity:
    def __init__(self, name: str, params: Params) -> None:
        self.name = name
        self.p = params

    def score(self, req: PickRequest, cands: list[Candidate]) -> Sequence[float]:
        scores = [0.0] * len(cands)
        if req.first_turn and prompt_blocks(req) < self.p.first_turn_blocks:
            return scores
        if req.prefix_blocks:
            key = req.prefix_blocks[0]
        elif req.session is not None:
            key = stable_hash(req.session)
        else:
            return scores
        best = owner(key, cands, self.p.bound, self.p.slack)
        most = max((c.kv_held or 0 for c in cands), default=0)
        if (cands[best].kv_held or 0) < most:
            return scores  # another pod really holds more of it
        if not self.p.imbalance.yields(cands[best], cands):
            scores[best] = 1.0
        return scores


def factory(name: str, params: Mapping[str, Any]) -> SessionAffinity:
    return SessionAffinity(name, parse_params(Params, name, params))
