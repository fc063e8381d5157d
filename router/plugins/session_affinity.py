"""Scorer: keep a session on one pod, the same on every router replica.

The session's pod is derived, not stored: rendezvous (highest-random-weight) hashing of the
session ID over the candidate pods, with a process-independent hash. Two replicas with the same
view of the fleet pick the same pod, with no shared state and no Redis on the pick path; when a
pod leaves, only its sessions move. Yields (all zeros) when that pod is overloaded per the
imbalance thresholds, so affinity never makes a hot spot.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from llmgw.config import Strict
from router.balance import Imbalance
from router.plugins.base import parse_params
from router.types import Candidate, PickRequest

TYPE = "session-affinity"
_MASK = (1 << 64) - 1


class Params(Strict):
    imbalance: Imbalance = Imbalance()


@lru_cache(maxsize=65536)
def stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def _mix(x: int) -> int:
    """splitmix64 finaliser."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def owner(session: str, cands: list[Candidate]) -> int:
    """Index of the session's rendezvous pod among the candidates."""
    key = stable_hash(session)
    weights = [_mix(key ^ stable_hash(c.pod)) for c in cands]
    return max(range(len(cands)), key=weights.__getitem__)


class SessionAffinity:
    def __init__(self, name: str, params: Params) -> None:
        self.name = name
        self.imbalance = params.imbalance

    def score(self, req: PickRequest, cands: list[Candidate]) -> Sequence[float]:
        scores = [0.0] * len(cands)
        if req.session is None:
            return scores
        best = owner(req.session, cands)
        if not self.imbalance.yields(cands[best], cands):
            scores[best] = 1.0
        return scores


def factory(name: str, params: Mapping[str, Any]) -> SessionAffinity:
    return SessionAffinity(name, parse_params(Params, name, params))
