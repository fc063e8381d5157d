"""Where counters live: the contract, and the in-process store used when Redis is out of reach.

Both stores follow windows.py exactly. The Redis one (redis_store.py) is shared by every replica;
this one holds only this replica's share of each limit (types.share: ⌊limit / replicas⌋, at
least 1) and starts from what Redis last said: each bucket of a check's last Redis answer counts
⌈count / replicas⌉, so the replicas together start where Redis stood. What it admits itself is
kept apart (`take`), to be added to Redis when Redis is back (failover.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ratelimit.types import Check, Grant, StoreResult, Window, granted, share
from ratelimit.windows import used

Key = tuple[str, str]  # (tenant prefix, check name)
# Made here and not yet in Redis: per key, the check's window and bucket index → count.
Made = dict[Key, tuple[Window, dict[int, int]]]


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
        grant: Grant | None = None,
        breaker: str = "",
    ) -> StoreResult:
        """Test every check; if all pass (or shadow), add each cost; record the token costs as
        reservation `reservation` for the ledger to settle (Redis only). With `grant`, a hard
        budget (Check.caps) that the cost does not fit lowers the request's output cap to what
        it has left, when that is at least 1 (types.Grant; StoreResult.cap). `now_ms` is the
        caller's clock, for a store without one of its own: Redis decides at its TIME, and
        either way StoreResult.now_ms says which time was used. `breaker`: the tenant's breaker key,
        consulted first (Redis only: StoreResult.circuit_ms); "" for none."""
        ...


class LocalStore:
    """In-process counters with the same rule as the Redis script. Reservations made here are
    never settled (the ledger settles in Redis): they stay charged, the strict side."""

    def __init__(self, replicas: int = 1) -> None:
        self.replicas = replicas  # of the fleet: each limit's share is 1 / replicas
        # Each check's last Redis answer: its current bucket index and buckets after it.
        self._seen: dict[Key, tuple[int, tuple[int, ...], int]] = {}
        self._made: Made = {}

    def remember(
        self, prefix: str, checks: Sequence[Check], outcome: StoreResult, added: bool
    ) -> None:
        """Keep a Redis answer to start from (cheap: it runs on every Redis decision)."""
        for check, counts in zip(checks, outcome.counts, strict=True):
            current = check.window.index(outcome.now_ms)
            self._seen[(prefix, check.name)] = (current, counts, check.cost if added else 0)

    def take(self) -> Made:
        """The counts made here since the last take, now in the caller's hands."""
        made, self._made = self._made, {}
        return made

    def give_back(self, made: Made) -> None:
        """Counts taken but not delivered, counted here again."""
        for key, (window, buckets) in made.items():
            mine = self._made.setdefault(key, (window, {}))[1]
            for index, count in buckets.items():
                mine[index] = mine.get(index, 0) + count

    async def admit(
        self,
        prefix: str,
        checks: Sequence[Check],
        now_ms: int,
        *,
        shadow: bool = False,
        reservation: str = "",
        ttl_ms: int = 0,
        grant: Grant | None = None,
        breaker: str = "",  # not seen without Redis: degraded decisions ignore the breaker
    ) -> StoreResult:
        counts = tuple(self._buckets(prefix, check, now_ms) for check in checks)
        standing = [
            (used(check.window, seen, now_ms), share(check.limit, self.replicas))
            for check, seen in zip(checks, counts, strict=True)
        ]
        cap = 0
        if grant is not None:
            caps = [
                grant.money_cap(limit - u) if check.money else grant.cap(limit - u)
                for check, (u, limit) in zip(checks, standing, strict=True)
                if check.reserve and check.caps and u + check.cost > limit
            ]
            cap = max(0, min(caps, default=0))
            checks = granted(checks, grant, cap)
        ok = all(
            u + check.cost <= limit for check, (u, limit) in zip(checks, standing, strict=True)
        )
        if ok or shadow:
            for check in checks:
                if check.cost > 0:
                    current = check.window.index(now_ms)
                    made = self._made.setdefault((prefix, check.name), (check.window, {}))[1]
                    made[current] = made.get(current, 0) + check.cost
        return StoreResult(ok, counts, now_ms, self.replicas, local=True, cap=cap)

    def _buckets(self, prefix: str, check: Check, now_ms: int) -> tuple[int, ...]:
        """The check's buckets, newest first: this replica's share of Redis's last answer plus
        what was made here. Buckets that left the window are dropped."""
        w = check.window
        current = w.index(now_ms)
        key = (prefix, check.name)
        made = self._made.get(key, (w, {}))[1]
        for index in [i for i in made if i <= current - w.span]:
            del made[index]
        seen_at, seen, extra = self._seen.get(key, (current, (), 0))
        n = self.replicas
        out = []
        for age in range(w.span):
            index = current - age
            count = made.get(index, 0)
            back = seen_at - index
            if 0 <= back < len(seen):
                count += -(-(seen[back] + (extra if back == 0 else 0)) // n)
            out.append(count)
        return tuple(out)
