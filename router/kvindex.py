"""What each pod's prefix cache holds, as its own KV events say (router/collectors/kvevents.py):
block hash → the pods holding it, per pod the set of its hashes and its block size.

The hashes are the pods' own (llmgw/kvblocks.py computes a request's alike), so a lookup is the
number of leading blocks a pod really holds, not a guess. A pod's entries go when it says so
(`BlockRemoved`, `AllBlocksCleared`), when it restarts or misses events beyond replay, and when
it leaves the fleet; a pod that reports holding more than `max_blocks` blocks (no pod's cache
is that large) is forgotten rather than grown without bound.

A block most often lives on one pod: its holder is then the pod ID itself, a set only once a
second pod holds it (bench/kv_index.py: bytes per entry).
"""

from __future__ import annotations

from collections.abc import Iterable

from router.types import Candidate, PodId


class _Pod:
    __slots__ = ("block_size", "hashes")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.hashes: set[int] = set()


class KvIndex:
    def __init__(self, max_blocks: int = 1 << 22) -> None:
        self.max_blocks = max_blocks
        self._pods: dict[PodId, _Pod] = {}
        self._where: dict[int, PodId | set[PodId]] = {}

    def stored(self, pod: PodId, hashes: Iterable[int], block_size: int) -> None:
        entry = self._pods.get(pod)
        if entry is None or entry.block_size != block_size:
            self.drop(pod)  # a pod's block size changes only when it restarts
            entry = self._pods[pod] = _Pod(block_size)
        where = self._where
        for h in hashes:
            if h in entry.hashes:
                continue
            entry.hashes.add(h)
            holders = where.get(h)
            if holders is None:
                where[h] = pod
            elif isinstance(holders, str):
                where[h] = {holders, pod}
            else:
                holders.add(pod)
        if len(entry.hashes) > self.max_blocks:
            self.drop(pod)

    def removed(self, pod: PodId, hashes: Iterable[int]) -> None:
        entry = self._pods.get(pod)
        if entry is None:
            return
        for h in hashes:
            if h in entry.hashes:
                entry.hashes.discard(h)
                self._unlink(h, pod)

    def cleared(self, pod: PodId) -> None:
        """The pod holds nothing now (it said so, restarted, or lost events): known empty."""
        entry = self._pods.get(pod)
        if entry is None:
            return
        for h in entry.hashes:
            self._unlink(h, pod)
        entry.hashes = set()

    def drop(self, pod: PodId) -> None:
        """Forget the pod (gone from the fleet, or no longer believed): not known, not empty."""
        self.cleared(pod)
        self._pods.pop(pod, None)

    def reset(self) -> None:
        """Forget every pod."""
        self._pods.clear()
        self._where.clear()

    def _unlink(self, h: int, pod: PodId) -> None:
        holders = self._where.get(h)
        if isinstance(holders, str):
            if holders == pod:
                del self._where[h]
        elif holders is not None:
            holders.discard(pod)
            if len(holders) == 1:
                self._where[h] = next(iter(holders))

    def match(self, blocks: tuple[int, ...], block_size: int) -> dict[PodId, int]:
        """Per pod of that block size, how many of the leading `blocks` it holds (absent: none)."""
        depth: dict[PodId, int] = {}
        alive: set[PodId] | None = None
        for i, h in enumerate(blocks, 1):
            holders = self._where.get(h)
            if holders is None:
                break
            pods = {holders} if isinstance(holders, str) else holders
            alive = set(pods) if alive is None else alive & pods
            if not alive:
                break
            for pod in alive:
                depth[pod] = i
        return {p: d for p, d in depth.items() if self._pods[p].block_size == block_size}

    def annotate(self, blocks: tuple[int, ...], block_size: int, cands: list[Candidate]) -> bool:
        """Each candidate that publishes events in this block size learns how many of the
        request's leading blocks it holds (`kv_held`); the others keep None (not known). True
        if any holds some."""
        held = self.match(blocks, block_size)
        pods = self._pods
        for c in cands:
            entry = pods.get(c.pod)
            if entry is not None and entry.block_size == block_size:
                c.kv_held = held.get(c.pod, 0)
        return bool(held)

    def publishes(self, pod: PodId) -> bool:
        return pod in self._pods

    def size(self, pod: PodId) -> int:
        entry = self._pods.get(pod)
        return 0 if entry is None else len(entry.hashes)

    def entries(self) -> int:
        """Distinct hashes held anywhere."""
        return len(self._where)
