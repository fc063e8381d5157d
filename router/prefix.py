"""What each pod's prefix cache holds, as far as the router's own picks tell (the hashes come from
extauthz's request facts: llmgw/facts.py).

Per pod an LRU of 16-token blocks as large as its KV cache (`vllm:cache_config_info`), charged
with every block of every prompt sent there, not only the hashed leading ones: the facts hash at
most `max_prefix_blocks` blocks, and a 3000-token prompt is three times that. The blocks after
the last hashed one are charged as two entries under that block: the part every prompt with this
hashed prefix shares (a system prompt's rest, estimated as the shortest such rest seen) and the
conversation's own part (its latest prompt, by session). A pod evicts a prompt's last blocks
first (vLLM frees them last block first), so the entries are touched in that order: own rest,
shared rest, then the hashed blocks from last to first.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from router.types import PodId

# A hashed block, or the rest of a prompt after hashed block h: (h, None) shared, (h, session)
# the conversation's own ("" without a session).
Key = int | tuple[int, str | None]


@dataclass(slots=True)
class _Entry:
    blocks: int
    used: float  # clock time of the last pick that sent it here


class _PodMap:
    __slots__ = ("entries", "total")

    def __init__(self) -> None:
        self.entries: OrderedDict[Key, _Entry] = OrderedDict()  # least recently used first
        self.total = 0

    def touch(self, key: Key, blocks: int, now: float) -> bool:
        """Charge `blocks` under `key`, most recent now; True if the key is new."""
        entry = self.entries.get(key)
        if entry is None:
            self.entries[key] = _Entry(blocks, now)
            self.total += blocks
            return True
        self.total += blocks - entry.blocks
        entry.blocks, entry.used = blocks, now
        self.entries.move_to_end(key)
        return False


class PrefixIndex:
    """Block hash → pods that recently served it; per pod an LRU sized like its KV cache."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._pods: dict[PodId, _PodMap] = {}
        self._where: dict[int, set[PodId]] = {}

    def match(self, blocks: tuple[int, ...]) -> dict[PodId, int]:
        """Per pod, how many leading hashed blocks it holds."""
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

    def held(self, blocks: tuple[int, ...], session: str | None, total: int) -> dict[PodId, int]:
        """Per pod, how many of the prompt's `total` blocks it holds, its rest included."""
        held = self.match(blocks)
        last = blocks[-1]
        for pod, depth in held.items():
            if depth < len(blocks):
                continue
            entries = self._pods[pod].entries
            shared = entries.get((last, None))
            if shared is not None:
                own = entries.get((last, session or ""))
                depth += shared.blocks + (own.blocks if own is not None else 0)
            held[pod] = min(depth, total)
        return held

    def record(
        self,
        pod: PodId,
        blocks: tuple[int, ...],
        session: str | None,
        total: int,
        capacity: int,
    ) -> None:
        """A prompt of `total` blocks, `blocks` of them hashed, sent to `pod`."""
        now = self.clock()
        lru = self._pods.setdefault(pod, _PodMap())
        rest = total - len(blocks)
        if rest > 0:
            last = blocks[-1]
            shared = lru.entries.get((last, None))
            common = rest if shared is None else min(shared.blocks, rest)
            if rest > common:
                lru.touch((last, session or ""), rest - common, now)
            lru.touch((last, None), common, now)
        for h in reversed(blocks):
            if lru.touch(h, 1, now):
                self._where.setdefault(h, set()).add(pod)
        while lru.total > max(capacity, 0):
            key, entry = lru.entries.popitem(last=False)
            lru.total -= entry.blocks
            if isinstance(key, int):
                holders = self._where.get(key)
                if holders is not None:
                    holders.discard(pod)
                    if not holders:
                        del self._where[key]

    def idle_evicted(self, pod: PodId, blocks: int, capacity: int) -> float:
        """Seconds since the most recently used of the entries that `blocks` more blocks would
        evict from `pod` was last used; infinite when they fit without evicting."""
        lru = self._pods.get(pod)
        if lru is None or not lru.entries:
            return float("inf")
        over = lru.total + blocks - capacity
        if over <= 0:
            return float("inf")
        if over >= lru.total:  # all of it: a prompt as large as the cache (O(1), not a walk)
            return self.clock() - next(reversed(lru.entries.values())).used
        used = float("-inf")
        for entry in lru.entries.values():
            used = entry.used
            over -= entry.blocks
            if over <= 0:
                break
        return self.clock() - used

    def size(self, pod: PodId) -> int:
        """Blocks charged to `pod`."""
        lru = self._pods.get(pod)
        return lru.total if lru is not None else 0
