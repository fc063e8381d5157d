"""An immutable map that a change copies only in part, for the snapshot of a database source.

A snapshot is swapped in one assignment and never changed (requests in flight keep theirs), so a
change must make a new map. Copying a dict of 1,000,000 keys costs ~30 ms per change; this map
is `SHARDS` dicts by hash, and a change copies the tuple of them and only the dicts it touches:
O(SHARDS + n / SHARDS) references (~1,000 + ~1,000 at 1,000,000 keys), a lookup one more index.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from itertools import chain
from typing import TypeVar, overload

K = TypeVar("K")
V = TypeVar("V")
D = TypeVar("D")

SHARDS = 1024  # √ of the 1,000,000 keys the design is sized for; a power of two (mask)
_MASK = SHARDS - 1


class Sharded(Mapping[K, V]):
    __slots__ = ("_len", "_shards")

    def __init__(self, shards: tuple[dict[K, V], ...], length: int) -> None:
        self._shards = shards
        self._len = length

    @classmethod
    def of(cls, items: Iterable[tuple[K, V]] = ()) -> Sharded[K, V]:
        shards: tuple[dict[K, V], ...] = tuple({} for _ in range(SHARDS))
        for key, value in items:
            shards[hash(key) & _MASK][key] = value
        return cls(shards, sum(len(s) for s in shards))

    def evolve(self, put: Mapping[K, V], drop: Iterable[K] = ()) -> Sharded[K, V]:
        """A new map: `drop` removed (absent keys ignored), then `put` set; this one unchanged."""
        shards = list(self._shards)
        copied: set[int] = set()
        length = self._len

        def shard(key: K) -> dict[K, V]:
            i = hash(key) & _MASK
            if i not in copied:
                shards[i] = dict(shards[i])
                copied.add(i)
            return shards[i]

        for key in drop:
            if key in shards[hash(key) & _MASK]:
                del shard(key)[key]
                length -= 1
        for key, value in put.items():
            found = shard(key)
            length += key not in found
            found[key] = value
        return Sharded(tuple(shards), length)

    @overload
    def get(self, key: K, /) -> V | None: ...
    @overload
    def get(self, key: K, default: V | D, /) -> V | D: ...
    def get(self, key: K, default: object = None) -> object:
        return self._shards[hash(key) & _MASK].get(key, default)

    def __getitem__(self, key: K) -> V:
        return self._shards[hash(key) & _MASK][key]

    def __contains__(self, key: object) -> bool:
        return key in self._shards[hash(key) & _MASK]

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[K]:
        return chain.from_iterable(self._shards)
