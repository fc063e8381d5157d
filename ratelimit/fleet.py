"""The fleet load as the rate limiter reads it (the contract: llmgw/fleetload.py).

A missing, malformed or stale (older than `stale_after_s`, default 3 s) signal counts as load 1,
and an unknown capacity as 0: nothing to borrow (ratelimit/pool.py). Each replica caches the key
for `cache_s` (default 0.5 s) and refreshes it in the background, read or not, so no decision
waits for it.
The view is also the fleet's contexts (`ModelContexts`) where the router runs apart: the last
ones read, whatever their age (a context changes only with a pod's flags); none past the key's TTL.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable

from pydantic import ValidationError

from llmgw.fleetload import FleetLoad

IDLE_UNKNOWN = FleetLoad(load=1.0, capacity_tpm=0, capacity_rpm=0, ts=0.0)


def parse(raw: bytes | None) -> FleetLoad:
    """The key's value (None: absent); anything unreadable is load 1."""
    if raw is None:
        return IDLE_UNKNOWN
    try:
        return FleetLoad.model_validate_json(raw)
    except ValidationError:
        return IDLE_UNKNOWN


def effective_load(fleet: FleetLoad, now_s: float, stale_after_s: float) -> float:
    return fleet.load if now_s - fleet.ts <= stale_after_s else 1.0


class FleetView:
    """The last fleet signal read, refreshed in the background at most every `cache_s`."""

    def __init__(
        self,
        fetch: Callable[[], Awaitable[bytes | None]],
        clock: Callable[[], float],
        cache_s: float = 0.5,
    ) -> None:
        self._fetch = fetch
        self._clock = clock
        self.cache_s = cache_s
        self.current = IDLE_UNKNOWN
        self._fetched_at = -math.inf
        self._refresh: asyncio.Task[None] | None = None

    def snapshot(self) -> FleetLoad:
        """The cached signal; starts a refresh when it is older than `cache_s`."""
        now = self._clock()
        if now - self._fetched_at >= self.cache_s and self._refresh is None:
            self._fetched_at = now
            self._refresh = asyncio.get_running_loop().create_task(self._update())
        return self.current

    async def run(self) -> None:
        """Refresh every `cache_s` (at least 0.05 s) whether read or not: a replica just started
        or long idle then holds the current signal, not the one of its last read (extauthz's
        first decisions read the contexts before any admission does)."""
        while True:
            self.snapshot()
            await asyncio.sleep(max(self.cache_s, 0.05))

    def context(self, model: str) -> int | None:
        return self.snapshot().contexts.get(model)

    async def _update(self) -> None:
        try:
            self.current = parse(await self._fetch())
        finally:
            self._refresh = None
