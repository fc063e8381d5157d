"""Which pods recently served which prompt blocks (the hashes come from extauthz's request
facts: llmgw/facts.py)."""

from __future__ import annotations

from collections import OrderedDict

from router.types import PodId


class PrefixIndex:
    """Block hash → pods that recently served it; per pod an LRU sized like its KV cache."""

    def __init__(self) -> None:
        self._pods: dict[PodId, OrderedDict[int, None]] = {}
        self._where: dict[int, set[PodId]] = {}

    def match(self, blocks: tuple[int, ...]) -> dict[PodId, int]:
        """Per pod, how many leading blocks it holds."""
        depth: dict[PodId, int] = {}
        alive: set[PodId] | None = None
        for i, h in enumerate(blocks, 1):
            pods = self._where.get(h)
            if not pods:
                break
            alive = set(pods) if alive is None else alive & pods
            if not alive:
                break
            for pod in alive:
                depth[pod] = i
        return depth

    def record(self, pod: PodId, blocks: tuple[int, ...], capacity: int) -> None:
        lru = self._pods.setdefault(pod, OrderedDict())
        for h in reversed(blocks):  # leading blocks end most recent: the tail is evicted first
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                self._where.setdefault(h, set()).add(pod)
        while len(lru) > max(capacity, 0):
            old, _ = lru.popitem(last=False)
            holders = self._where.get(old)
            if holders is not None:
                holders.discard(pod)
                if not holders:
                    del self._where[old]

    def size(self, pod: PodId) -> int:
        return len(self._pods.get(pod, ()))
