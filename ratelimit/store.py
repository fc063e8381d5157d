"""Where counters live: the contract, and the in-process store used when Redis is out of reach.

Both stores follow windows.py exactly; the Redis one (redis_store.py) is shared by every replica,
this one holds only this replica's share of each limit (limit × share, rounded down).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass
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
        """Test every check; if all pass (or shadow), add each cost; reserve the token costs."""
        ...

    async def settle(
        self, prefix: str, request_id: str, tokens: int, checks: Sequence[Check], now_ms: int
    ) -> tuple[bool, int]:
        """Settle a reservation to `tokens` (or charge them): (reservation found, tokens added)."""
        ...


@dataclass(slots=True)
class _Reservation:
    prefix: str
    amount: int
    buckets: list[tuple[str, int]]  # (check name, bucket index)
    expires_ms: int


class LocalStore:
    """In-process counters with the same rule and semantics as the Redis script."""

    def __init__(self, share: float = 1.0) -> None:
        self.share = share
        self._buckets: dict[tuple[str, str], dict[int, int]] = {}
        self._reservations: collections.OrderedDict[str, _Reservation] = collections.OrderedDict()

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
        self._expire(now_ms)
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
            taken: list[tuple[str, int]] = []
            amount = 0
            for check in checks:
                if check.cost <= 0:
                    continue
                current = now_ms // check.window.bucket_ms
                buckets = self._buckets[(prefix, check.name)]
                buckets[current] = buckets.get(current, 0) + check.cost
                if check.reserve:
                    taken.append((check.name, current))
                    amount = check.cost
            if reservation and taken:
                self._reservations[reservation] = _Reservation(
                    prefix, amount, taken, now_ms + ttl_ms
                )
        return Outcome(ok, tuple(counts), self.share, local=True)

    async def settle(
        self, prefix: str, request_id: str, tokens: int, checks: Sequence[Check], now_ms: int
    ) -> tuple[bool, int]:
        held = self._reservations.pop(request_id, None) if request_id else None
        if held is not None:
            self._add(held.prefix, held.buckets, tokens - held.amount)
            return True, tokens - held.amount
        for check in checks:
            series = self._series(prefix, check, now_ms)
            current = now_ms // check.window.bucket_ms
            series[current] = series.get(current, 0) + tokens
        return False, tokens

    def _series(self, prefix: str, check: Check, now_ms: int) -> dict[int, int]:
        """The check's buckets, with those that left the window dropped."""
        buckets = self._buckets.setdefault((prefix, check.name), {})
        oldest = now_ms // check.window.bucket_ms - check.window.buckets + 1
        for index in [i for i in buckets if i < oldest]:
            del buckets[index]
        return buckets

    def _add(self, prefix: str, buckets: list[tuple[str, int]], delta: int) -> None:
        for name, index in buckets:
            series = self._buckets.get((prefix, name))
            if series is not None and index in series:
                series[index] += delta

    def _expire(self, now_ms: int) -> None:
        # Reservations are inserted in expiry order (one TTL), so the oldest come first.
        while self._reservations:
            rid, held = next(iter(self._reservations.items()))
            if held.expires_ms > now_ms:
                break
            del self._reservations[rid]
            self._add(held.prefix, held.buckets, -held.amount)
