"""The fleet-load publisher: the fleet's utilisation, measured capacity and contexts
(llmgw/fleetload.py), written to Redis every `publish_interval` seconds with a TTL of
`publish_ttl` seconds, for the rate limiter's borrowing pool (ratelimit/fleet.py) and, where the
router runs apart, extauthz's output cap; and each pod's batch at each scrape since
(llmgw/podbatches.py), added to a stream for the ledger's GPU time (ledger/gputime.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from llmgw import wire
from llmgw.fleetload import FleetLoad
from llmgw.link import RedisLink
from llmgw.podbatches import SCRAPES_KEPT, STREAM_KEPT, PodBatches, Scrape
from llmgw.resp import RespError
from router import metrics
from router.capacity import utilisation
from router.fleet import Fleet
from router.types import PodId

log = logging.getLogger(__name__)


class ScrapeLog:
    """Each pod's running requests at each good scrape since the last entry, at the scrape's
    Unix time (a fleet listener: `fleet.listeners.append(log.scraped)`); a pod's latest
    SCRAPES_KEPT."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.pending: dict[PodId, deque[Scrape]] = {}

    def scraped(self, pod: PodId) -> None:
        snap = self.fleet.snapshots.get(pod)
        if snap is None or not snap.ok:
            return
        at = round(time.time() - (self.fleet.clock() - snap.at), 3)
        scrapes = self.pending.get(pod)
        if scrapes is None:
            scrapes = self.pending[pod] = deque(maxlen=SCRAPES_KEPT)
        scrapes.append(Scrape(at, snap.running))

    def take(self) -> PodBatches:
        """What arrived since the last call, of the pods still in the fleet."""
        pods = {p: list(s) for p, s in self.pending.items() if p in self.fleet.snapshots}
        self.pending = {}
        return PodBatches(ts=round(time.time(), 3), pods=pods)


def fleet_load(fleet: Fleet) -> FleetLoad:
    """The mean utilisation over the known pods, a pod the router would not pick (unhealthy, or
    its metrics stale) counting as 1, and the capacity the pickable ones were measured at."""
    now = fleet.clock()
    utils: list[float] = []
    pickable: list[PodId] = []
    for c in fleet.candidates():
        if c.healthy and c.fresh:
            pickable.append(c.pod)
            utils.append(utilisation(c.metrics, c.capacity))
        else:
            utils.append(1.0)
        age = now - c.metrics.at
        metrics.SCRAPE_AGE.labels(c.pod).set(age if age != float("inf") else -1.0)
    load = sum(utils) / len(utils) if utils else 1.0
    metrics.FLEET_LOAD.set(load)
    tpm, rpm = fleet.capacity.per_minute(pickable)
    return FleetLoad(
        load=round(load, 4),
        capacity_tpm=tpm,
        capacity_rpm=rpm,
        ts=round(time.time(), 3),
        contexts=fleet.contexts.current,
    )


async def run(fleet: Fleet, redis: RedisLink) -> None:
    """Publish every `publish_interval`; Redis errors are logged, not fatal (the next round
    connects again)."""
    s = fleet.settings
    scrapes = ScrapeLog(fleet)
    fleet.listeners.append(scrapes.scraped)
    while True:
        payload = fleet_load(fleet).model_dump_json()
        batches = scrapes.take()
        try:
            async with asyncio.timeout(s.publish_interval):  # connecting included
                client = await redis.get()
                await client.call(
                    "SET", wire.FLEET_LOAD_KEY, payload, "PX", int(s.publish_ttl * 1000)
                )
                if batches.pods:
                    await client.call(
                        "XADD", wire.POD_BATCHES_KEY, "MAXLEN", "~", str(STREAM_KEPT), "*",
                        "b", batches.model_dump_json(),
                    )  # fmt: skip
        except (TimeoutError, ConnectionError, OSError, RespError) as exc:
            log.warning("fleet load publish failed", extra={"error": repr(exc)})
        await asyncio.sleep(s.publish_interval)
