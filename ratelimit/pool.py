"""The fleet's borrowing pool: idle capacity that every borrowing tenant draws from, together.

Size, per window (kind × unit), from the fleet signal (ratelimit/fleet.py):

    capacity per minute × min(window, 1 min) / 1 min × (0.7 − load) × 0.8    while load < 0.7

and 0 otherwise, when the signal is stale or absent, or the capacity unknown (seed 003 §1.2).
Hour and day windows get the minute's amount, not 60× or 1440× it: an idle minute seen now says
nothing about the rest of the day.

Counter: each window is a rolling window with the tenants' bucket layout (windows.SLIDING) and
their rule (windows.py: N buckets plus the one before them, decaying), at Redis's own time, under
`llmgw:pool:{fleet}:<kind>:<unit>:<bucket>`. A draw then decays out of the pool as the use it
paid for decays out of the tenant's window (the same buckets on the same clock), whichever
replica's clock is off. The hash tag puts every pool key in one Redis Cluster slot, not the
tenant's, so a draw is its own script call (borrow.lua), made only when a tenant's base limits
refuse and its tier may borrow: a base-quota decision stays one round trip.

Share: a draw passes while the pool's use after it stays within share × size (llmgw/tiers.py's
`borrow_share`): platinum (1.0) up to the whole pool, standard (0.5) while less than half of it
is used, free (0) never. Use is everyone's, so standard tenants together take at most half, and
platinum may take what they leave. Hard budgets never borrow.

Commit (limiter.py), three round trips on the borrowing path:
1. admit.lua with the base limits refuses on a rate limit (a refused admission adds nothing).
2. For each refusing window the request's excess is what it needs above both the base limit and
   the tenant's current use: used + cost − max(base, used) (use above base was drawn before).
   borrow.lua draws all excesses at once, all or nothing, into the pool's current buckets.
3. admit.lua again, each refusing window's limit raised by its draw: to base + draw when part of
   the cost fits under the base limit, unbounded when all of it was drawn (whatever the window
   holds then, its use above base grows by at most the draw). Concurrent borrowers of a tenant
   therefore do not refuse each other; the second admission fails only if a window that passed
   in step 1 (or one that drew part of its cost) filled up in between. Then the draws go back
   into the buckets they were drawn into, and the first refusal stands.
So in every window a tenant's use above its base limit never exceeds what it drew there, and the
pool counts every draw as long as the tenant's window counts what it paid for. A replica that
dies, or a Redis that stops answering, between 2 and 3 leaves a draw in the pool unused: the
strict side, for at most one window. Degraded decisions (in-process counters) and shadow
decisions do not borrow.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from llmgw import wire
from llmgw.fleetload import FleetLoad
from llmgw.resp import Arg, Client, Reply, RespError
from ratelimit.redis_store import run, script
from ratelimit.types import UNIT_MS, Kind, Unit
from ratelimit.windows import SLIDING

log = logging.getLogger(__name__)

BORROW_BELOW = 0.7
BORROW_FACTOR = 0.8
BORROW = script("borrow.lua")
FAILURES = (TimeoutError, ConnectionError, OSError, RespError)


def size(fleet: FleetLoad, load: float, kind: Kind, unit: Unit) -> int:
    """The pool of one window: what all borrowing tenants together may draw in it, at the
    fleet's effective load (fleet.effective_load: 1 when the signal is stale)."""
    if load >= BORROW_BELOW:
        return 0
    per_minute = fleet.capacity_tpm if kind == "tokens" else fleet.capacity_rpm
    span = min(UNIT_MS[unit], UNIT_MS[Unit.MINUTE]) / UNIT_MS[Unit.MINUTE]
    return round(per_minute * span * (BORROW_BELOW - load) * BORROW_FACTOR)


@dataclass(frozen=True, slots=True)
class Draw:
    """An amount drawn from one window of the pool, and the bucket it went into."""

    kind: Kind
    unit: Unit
    amount: int
    bucket: str = ""

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.unit.value}"


class Pool:
    """The pool in Redis; `client` is the connection decisions use now (None while degraded)."""

    def __init__(
        self,
        client: Callable[[], Client | None],
        *,
        deadline_s: float,
        prefix: str = wire.POOL_PREFIX,
    ) -> None:
        self.client = client
        self.deadline_s = deadline_s
        self.prefix = prefix

    async def draw(
        self, fleet: FleetLoad, load: float, share: float, wants: Sequence[Draw]
    ) -> tuple[Draw, ...] | None:
        """Every wanted amount drawn at once, each with its bucket; None when the pool (or
        Redis) says no. Nothing is asked of Redis when a cap alone already refuses, nor for an
        amount of 0 (a check refused at cost 0 is in debt: borrowing does not repay it)."""
        args: list[Arg] = ["draw", len(wants)]
        for want in wants:
            cap = int(share * size(fleet, load, want.kind, want.unit))
            if not 0 < want.amount <= cap:
                return None
            w = SLIDING[want.unit]
            args += [want.name, w.bucket_ms, w.buckets, cap, want.amount]
        reply = await self._call(args)
        if not isinstance(reply, bytes) or not reply.startswith(b"1"):
            return None
        buckets = reply.decode().split()[1:]
        return tuple(
            Draw(w.kind, w.unit, w.amount, bucket) for w, bucket in zip(wants, buckets, strict=True)
        )

    async def give_back(self, draws: Sequence[Draw]) -> None:
        """Draws whose admission failed, back into their buckets (if those still exist)."""
        args: list[Arg] = ["back", len(draws)]
        for d in draws:
            args += [d.name, d.bucket, d.amount]
        await self._call(args)

    async def _call(self, args: list[Arg]) -> Reply:
        """borrow.lua's reply within the deadline; None when Redis is out of reach: the pool is
        then empty for this decision (Failover notices and degrades on the next admission)."""
        client = self.client()
        if client is None:
            return None
        keys: list[Arg] = [1, self.prefix]
        try:
            async with asyncio.timeout(self.deadline_s):
                return await run(client, BORROW, *keys, *args)
        except FAILURES as exc:
            log.warning("borrowing pool unavailable", extra={"error": repr(exc)})
            return None
