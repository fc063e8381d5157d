"""The fleet-load contract (router → ratelimit): the fleet's utilisation and measured capacity.

The router (router/fleet.py) writes Redis key `llmgw:fleet:load` (llmgw.wire.FLEET_LOAD_KEY)
every second or so as JSON (a hash with the same fields is read too):

    load            float 0-1   the fleet's utilisation (1 = saturated)
    capacity_tpm    int ≥ 0     tokens per minute the pickable pods can serve, measured from the
                                pods' own counters (router/capacity.py); 0 = not known yet
    capacity_rpm    int ≥ 0     requests per minute, measured the same way; 0 = not known yet
    ts              float       Unix seconds when it was measured

e.g. `SET llmgw:fleet:load '{"load": 0.3, "capacity_tpm": 3000000, "capacity_rpm": 6000,
"ts": 1767000000.5}'`. A missing, malformed or stale (older than `stale_after_s`, default 3 s)
signal counts as load 1, and an unknown capacity as 0: nothing to borrow (ratelimit/pool.py).
Each replica caches the key for `cache_s` (default 0.5 s) and refreshes it in the background,
so no decision waits for it.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FleetLoad:
    load: float
    capacity_tpm: int
    capacity_rpm: int
    ts: float


IDLE_UNKNOWN = FleetLoad(load=1.0, capacity_tpm=0, capacity_rpm=0, ts=0.0)


def parse(raw: bytes | dict[str, bytes] | None) -> FleetLoad:
    """The key's value (JSON bytes or hash fields); anything unreadable is load 1."""
    try:
        fields = json.loads(raw) if isinstance(raw, bytes) else raw
        if not isinstance(fields, dict):
            return IDLE_UNKNOWN
        load = float(fields["load"])
        ts = float(fields["ts"])
        tpm = int(float(fields.get("capacity_tpm", 0)))
        rpm = int(float(fields.get("capacity_rpm", 0)))
    except (KeyError, TypeError, ValueError, OverflowError):
        return IDLE_UNKNOWN
    if not (math.isfinite(load) and math.isfinite(ts)) or tpm < 0 or rpm < 0:
        return IDLE_UNKNOWN
    return FleetLoad(min(max(load, 0.0), 1.0), tpm, rpm, ts)


def effective_load(fleet: FleetLoad, now_s: float, stale_after_s: float) -> float:
    return fleet.load if now_s - fleet.ts <= stale_after_s else 1.0


class FleetView:
    """The last fleet signal read, refreshed in the background at most every `cache_s`."""

    def __init__(
        self,
        fetch: Callable[[], Awaitable[bytes | dict[str, bytes] | None]],
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

    async def _update(self) -> None:
        try:
            self.current = parse(await self._fetch())
        finally:
            self._refresh = None
