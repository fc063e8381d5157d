"""Every pod's `/metrics`, scraped concurrently every `scrape_interval` with a short timeout, and
its `/v1/models` every `models_interval`: each scrape replaces the pod's immutable `PodMetrics` in
the datastore (router/fleet.py). A failed scrape makes the pod unpickable until one succeeds."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from router import metrics
from router.collectors.scrape import Served, fetch_models, scrape_metrics
from router.fleet import Fleet
from router.types import PodId, PodMetrics

log = logging.getLogger(__name__)


class Scraper:
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self._models_at: dict[PodId, float] = {}  # when each pod's models were last fetched

    def session(self) -> aiohttp.ClientSession:
        """A session for the scrapes, sending the pods' key when they ask for one."""
        key = self.fleet.settings.pod_api_key
        headers = {} if key is None else {"authorization": f"Bearer {key.get_secret_value()}"}
        return aiohttp.ClientSession(headers=headers)

    async def scrape_once(self, session: aiohttp.ClientSession) -> None:
        """Every pod once. A scrape that fails in a way no pod should cause is logged and counts
        as a failed scrape of that pod: one pod's page never stops the others' scrapes."""
        pods = list(self.fleet.snapshots)
        for gone in self._models_at.keys() - set(pods):
            del self._models_at[gone]
        results = await asyncio.gather(
            *(self._scrape(session, pod) for pod in pods), return_exceptions=True
        )
        for pod, result in zip(pods, results, strict=True):
            if isinstance(result, Exception):
                log.error("scrape failed", extra={"pod": pod, "error": repr(result)})
                metrics.SCRAPE_ERRORS.labels(pod).inc()

    async def _scrape(self, session: aiohttp.ClientSession, pod: PodId) -> None:
        fleet = self.fleet
        s = fleet.settings
        started = fleet.clock()
        old = fleet.snapshots.get(pod)
        served = Served() if old is None else Served(old.models, old.contexts)
        if started - self._models_at.get(pod, float("-inf")) >= s.models_interval or not served.ids:
            fetched = await fetch_models(session, pod, s.scrape_timeout * 4)
            if fetched is not None:
                served = fetched
                self._models_at[pod] = started
        snap = await scrape_metrics(session, pod, s.scrape_timeout, started, served)
        if not snap.ok:
            metrics.SCRAPE_ERRORS.labels(pod).inc()
            snap = PodMetrics(pod, started, ok=False, models=served.ids, contexts=served.contexts)
        fleet.store(snap)

    async def run(self) -> None:
        fleet = self.fleet
        async with self.session() as session:
            while True:
                started = fleet.clock()
                await self.scrape_once(session)
                elapsed = fleet.clock() - started
                await asyncio.sleep(max(0.0, fleet.settings.scrape_interval - elapsed))
