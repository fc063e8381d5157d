"""The KV cache: a fixed pool of blocks, with a prefix cache over full prompt blocks.

A block is either free, private to one sequence, or cached under the hash of its prompt
prefix. Cached blocks are shared and reference-counted; at refcount 0 they stay cached but
evictable, oldest first, and count as free for new allocations.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.total = num_blocks
        self._free = num_blocks  # neither private nor cached
        self._refs: dict[int, int] = {}  # cached block hash -> references
        self._evictable: OrderedDict[int, None] = OrderedDict()  # refcount 0, oldest first

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
            self._free += 1
        self._free -= count
        return True

    def promote(self, block_hash: int) -> bool:
        """Turn a computed private block into a cached one (still referenced by its owner)."""
        if block_hash in self._refs:
            return False
        self._refs[block_hash] = 1
        return True

    def release(self, chain: Sequence[int], private: int) -> None:
        """Drop a sequence's blocks; its cached ones become evictable, last block first."""
        for block_hash in reversed(chain):
            self._refs[block_hash] -= 1
            if self._refs[block_hash] == 0:
                self._evictable[block_hash] = None
        self._free += private
