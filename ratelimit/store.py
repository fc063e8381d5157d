"""Where counters live: the contract, and the in-process store used when Redis is out of reach.

Both stores follow windows.py exactly; the Redis one (redis_store.py) is shared by every replica,
this one holds only this replica's share of each limit (limit × share, rounded down).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ratelimit.types import Check, Outcome


class Store(Protocol):
    async def admit(
        self,
        prefix: str,
        checks: Sequence[Check],
        now_ms: int,
        *,
        shadow: bool = False,
        reservation: str = "",
        ttl_ms: int = 0,
    ) -> Outcome:
        """Test every check; if all pass (or shadow), add each cost; record the token costs as
        reservation `reservation` for the ledger to settle (Redis only)."""
        ...


class LocalStore:
    """In-process counters with the same rule as the Redis script. Reservations made here are
    never settled (the ledger settles in Redis): they stay charged, the strict side."""

    def __init__(self, share: float = 1.0) -> None:
        self.share = share
        self._buckets: dict[tuple[str, str], dict[int, int]] = {}

    async def admit(
        self,
        prefix: str,
        checks: Sequence[Check],
        now_ms: int,
        *,
        shadow: bool = False,
        reservation: str = "",
        ttl_ms: int = 0,
    ) -> Outcome:
        counts: list[tuple[int, ...]] = []
        ok = True
        for check in checks:
            buckets = self._series(prefix, check, now_ms)
            current = now_ms // check.window.bucket_ms
            seen = tuple(buckets.get(current - age, 0) for age in range(check.window.buckets))
            counts.append(seen)
            if sum(seen) + check.cost > int(check.limit * self.share):
                ok = False
        if ok or shadow:
            for check in checks:
                if check.cost > 0:
                    current = now_ms // check.window.bucket_ms
                    buckets = self._buckets[(prefix, check.name)]
                    buckets[current] = buckets.get(current, 0) + check.cost
        return Outcome(ok, tuple(counts), self.share, local=True)

    def _series(self, prefix: str, check: Check, now_ms: int) -> dict[int, int]:
        """The check's buckets, with those that left the window dropped."""
        buckets = self._buckets.setdefault((prefix, check.name), {})
        oldest = now_ms // check.window.bucket_ms - check.window.buckets + 1
        for index in [i for i in buckets if i < oldest]:
            del buckets[index]
        return buckets
