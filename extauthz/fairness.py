"""Service received per tenant: the order of dispatch within a priority band (extauthz/queue.py),
least served first, as in virtual-token-counter and least-attained-service scheduling.

Each dispatch adds its request's tokens (its reservation: prompt + output cap × sequences) to its
tenant's count, which decays with half-life `half_life_s`, so that a tenant's past weighs less
the older it is. Counting tokens, not requests, is what keeps a tenant that sends fewer, larger
requests from taking more than its share. A tenant that comes back (nothing waiting or running)
to a band where others wait starts at the least count among them (`lift`), not at what its count
decayed to: it goes next, but does not then take every seat until it has caught up. A tenant
still running requests is not lifted: its small requests served at once are not a return.

Shared by the replicas (`Sharing`): every `share_interval_s` a replica sends what it dispatched
since its last batch to Redis (extauthz/served.lua, one round trip, off the request path) and
takes back every tenant's count, merged there; between batches it adds its own dispatches to the
last merged counts. Approximate: the reservation, not what the pod served (an answer that stops
early counts its cap); another replica's dispatches reach this one's order up to two intervals
late; while Redis cannot be reached each replica counts its own.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections.abc import Callable
from importlib import resources

from llmgw import wire
from llmgw.resp import Arg, Client, evalsha_each

log = logging.getLogger(__name__)

SOURCE = resources.files("extauthz").joinpath("served.lua").read_text()
SHA = hashlib.sha1(SOURCE.encode()).hexdigest()


class Served:
    def __init__(self, half_life_s: float) -> None:
        self.half_life_s = half_life_s
        self.rate = math.log(2) / half_life_s
        self._counts: dict[str, tuple[float, float]] = {}  # tenant: (count, when)
        # Not yet in a batch: tenant: (tokens dispatched, the floor it was lifted to, as of when)
        self._unsent: dict[str, tuple[float, float, float]] = {}

    def _decayed(self, count: float, at: float, now: float) -> float:
        return count * math.exp(-self.rate * (now - at)) if now > at else count

    def of(self, tenant: str, now: float) -> float:
        found = self._counts.get(tenant)
        return 0.0 if found is None else self._decayed(*found, now)

    def add(self, tenant: str, tokens: float, now: float) -> None:
        self._counts[tenant] = (self.of(tenant, now) + tokens, now)
        sent, floor = self._pending(tenant, now)
        self._unsent[tenant] = (sent + tokens, floor, now)

    def lift(self, tenant: str, floor: float, now: float) -> None:
        """The tenant's count at least `floor`."""
        if self.of(tenant, now) < floor:
            self._counts[tenant] = (floor, now)
            sent, lifted = self._pending(tenant, now)
            self._unsent[tenant] = (sent, max(floor, lifted), now)

    def _pending(self, tenant: str, now: float) -> tuple[float, float]:
        """What the tenant's batch holds (tokens, floor), decayed to `now`."""
        found = self._unsent.get(tenant)
        if found is None:
            return 0.0, 0.0
        sent, floor, at = found
        return self._decayed(sent, at, now), self._decayed(floor, at, now)

    def batch(self, now: float) -> list[tuple[str, float, float]]:
        """What this replica added since its last batch (tenant, tokens, floor), taken."""
        out = [(tenant, *self._pending(tenant, now)) for tenant in self._unsent]
        self._unsent = {}
        return out

    def unsend(self, batch: list[tuple[str, float, float]], now: float) -> None:
        """A batch that did not reach Redis, for the next one."""
        for tenant, tokens, floor in batch:
            sent, lifted = self._pending(tenant, now)
            self._unsent[tenant] = (sent + tokens, max(floor, lifted), now)

    def merge(self, shared: dict[str, float], now: float) -> None:
        """Every replica's counts (a batch's answer), with what this one added since."""
        counts = {t: (c, now) for t, c in shared.items()}
        for tenant in self._unsent:
            sent, floor = self._pending(tenant, now)
            counts[tenant] = (max(shared.get(tenant, 0.0), floor) + sent, now)
        self._counts = counts


class Sharing:
    """`served` merged with every replica's through Redis, every `interval_s`."""

    def __init__(
        self,
        served: Served,
        client: Callable[[], Client | None],
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.served = served
        self.client = client
        self.interval_s = interval_s
        self.clock = clock

    async def share(self) -> bool:
        """One batch out, the merged counts back; False: Redis not reachable (the batch goes
        with the next; meanwhile this replica orders by its own counts)."""
        client = self.client()
        now = self.clock()
        batch = self.served.batch(now)
        if client is None:
            self.served.unsend(batch, now)
            return False
        args: list[Arg] = [
            1,
            wire.FLOW_SERVED_KEY,
            round(self.served.half_life_s * 1000),
            round(self.served.half_life_s * 1000 * 30),  # below a token by then
        ]
        for tenant, tokens, floor in batch:
            args += [tenant, f"{tokens:.6f}", f"{floor:.6f}"]
        try:
            async with asyncio.timeout(self.interval_s):
                (reply,) = await evalsha_each(client, SOURCE, SHA, [args])
        except (ConnectionError, TimeoutError, OSError) as exc:
            reply = exc
        if not isinstance(reply, list):  # not reachable, or the script's error
            log.info("flow: service counts not shared", extra={"error": repr(reply)[:200]})
            self.served.unsend(batch, now)
            return False
        shared = {_text(reply[i]): float(_text(reply[i + 1])) for i in range(0, len(reply) - 1, 2)}
        self.served.merge(shared, self.clock())
        return True

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.share()


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
