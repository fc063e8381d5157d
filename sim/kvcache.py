"""The KV cache: a fixed pool of blocks, with a prefix cache over full prompt blocks.

A block is either free, private to one sequence, or cached under the hash of its prompt
prefix. Cached blocks are shared and reference-counted; at refcount 0 they stay cached but
evictable, oldest first, and count as free for new allocations.

Every block cached and every cached block evicted is logged, in order, for the pod's KV events
(`take_changes`, `kv_events`: vLLM's BlockStored and BlockRemoved).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from llmgw import kvevents

# One change to the cached blocks: (True, hash) cached, (False, hash) evicted.
Change = tuple[bool, int]


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.total = num_blocks
        self._free = num_blocks  # neither private nor cached
        self._refs: dict[int, int] = {}  # cached block hash -> references
        self._evictable: OrderedDict[int, None] = OrderedDict()  # refcount 0, oldest first
        self._changes: list[Change] = []

    @property
    def used(self) -> int:
        """Blocks referenced by some sequence."""
        return self.total - self._free - len(self._evictable)

    @property
    def available(self) -> int:
        """Blocks an allocation may take: free ones and unreferenced cached ones."""
        return self._free + len(self._evictable)

    def usage(self) -> float:
        return self.used / self.total

    def cached_prefix(self, chain: Sequence[int]) -> int:
        """How many leading blocks of a prompt's hash chain are cached."""
        hits = 0
        for block_hash in chain:
            if block_hash not in self._refs:
                break
            hits += 1
        return hits

    def acquire(self, chain: Sequence[int]) -> None:
        """Reference cached blocks (from `cached_prefix`)."""
        for block_hash in chain:
            if self._refs[block_hash] == 0:
                del self._evictable[block_hash]
            self._refs[block_hash] += 1

    def allocate(self, count: int) -> bool:
        """Take `count` private blocks, evicting unreferenced cached ones if needed."""
        if count > self.available:
            return False
        while self._free < count:
            block_hash, _ = self._evictable.popitem(last=False)
            del self._refs[block_hash]
            self._changes.append((False, block_hash))
            self._free += 1
        self._free -= count
        return True

    def promote(self, block_hash: int) -> bool:
        """Turn a computed private block into a cached one (still referenced by its owner)."""
        if block_hash in self._refs:
            return False
        self._refs[block_hash] = 1
        self._changes.append((True, block_hash))
        return True

    def release(self, chain: Sequence[int], private: int) -> None:
        """Drop a sequence's blocks; its cached ones become evictable, last block first."""
        for block_hash in reversed(chain):
            self._refs[block_hash] -= 1
            if self._refs[block_hash] == 0:
                self._evictable[block_hash] = None
        self._free += private

    def take_changes(self) -> list[Change]:
        """The changes since the last call, in order."""
        changes, self._changes = self._changes, []
        return changes


def kv_events(changes: Sequence[Change], block_size: int) -> list[kvevents.Event]:
    """The changes as vLLM's events, a run of stores or of evictions in one event each."""
    events: list[kvevents.Event] = []
    run: list[int] = []
    for i, (stored, block_hash) in enumerate(changes):
        run.append(block_hash)
        if i + 1 < len(changes) and changes[i + 1][0] == stored:
            continue
        hashes: list[int | bytes] = [kvevents.hash_value(h) for h in run]
        if stored:
            events.append(kvevents.BlockStored(hashes, None, [], block_size, medium="GPU"))
        else:
            events.append(kvevents.BlockRemoved(hashes, medium="GPU"))
        run = []
    return events
