"""The fleet-load contract (router → ratelimit) and how much idle capacity may be borrowed.

The router writes Redis key `llmgw:fleet:load` (llmgw.wire.FLEET_LOAD_KEY) every second or so,
either as a JSON string or as a hash with the same fields:

    load            float 0-1   the fleet's utilisation (1 = saturated)
    capacity_tpm    int ≥ 0     tokens per minute the whole fleet can serve (optional)
    capacity_rpm    int ≥ 0     requests per minute the whole fleet can serve (optional)
    ts              float       Unix seconds when it was measured

e.g. `SET llmgw:fleet:load '{"load": 0.3, "capacity_tpm": 3000000, "capacity_rpm": 6000,
"ts": 1767000000.5}'`. A missing, malformed or stale (older than `stale_after_s`, default 3 s)
signal counts as load 1: nothing to borrow.

Borrowable per window = capacity × (window / 1 min) × (0.7 − load) × 0.8 while load < 0.7,
times the tier's borrow share (platinum 1.0, standard 0.5, free 0). It is added to the base limit of
each request and token rate limit (never to a hard budget), and counted like any other use.
Each replica caches the key for `cache_s` (default 0.5 s) and refreshes it in the background,
so no decision waits for it.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ratelimit.types import UNIT_MS, Kind, Unit

BORROW_BELOW = 0.7
BORROW_FACTOR = 0.8


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
    except (KeyError, TypeError, ValueError):
        return IDLE_UNKNOWN
    if not (math.isfinite(load) and math.isfinite(ts)) or tpm < 0 or rpm < 0:
        return IDLE_UNKNOWN
    return FleetLoad(min(max(load, 0.0), 1.0), tpm, rpm, ts)


def effective_load(fleet: FleetLoad, now_s: float, stale_after_s: float) -> float:
    return fleet.load if now_s - fleet.ts <= stale_after_s else 1.0


def borrowable(
    fleet: FleetLoad, kind: Kind, unit: Unit, share: float, now_s: float, stale_after_s: float
) -> int:
    load = effective_load(fleet, now_s, stale_after_s)
    if load >= BORROW_BELOW or share <= 0:
        return 0
    per_minute = fleet.capacity_tpm if kind == "tokens" else fleet.capacity_rpm
    idle = per_minute * (UNIT_MS[unit] / 60_000) * (BORROW_BELOW - load) * BORROW_FACTOR
    return int(idle * share)


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

    async def refresh(self) -> FleetLoad:
        """Read the key now (start-up, tests)."""
        self._fetched_at = self._clock()
        await self._update()
        return self.current

    async def _update(self) -> None:
        try:
            self.current = parse(await self._fetch())
        finally:
            self._refresh = None
