"""The router as a part any process can hold: the pick's lifecycle (router/lifecycle.py) over the
fleet's datastore (router/fleet.py), with the collectors that keep the datastore current
(router/collectors/) and the fleet-load publisher (router/publisher.py) running beside it.

`python -m router` serves it behind ext_proc (router/service.py, router/picker.py); extauthz holds
one to pick inside its own Check, which saves the request path a gRPC exchange
(extauthz/service.py). Either way the outcomes come back on the access log
(router/collectors/outcomes.py), which `register` serves.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from envoy.service.accesslog.v3 import als_pb2_grpc
from opentelemetry import trace

from llmgw.link import RedisLink
from router import publisher
from router.collectors import kvevents
from router.collectors.outcomes import OutcomeService
from router.collectors.process import CollectorProcess
from router.collectors.resolver import Resolver
from router.collectors.scraper import Scraper
from router.engine import Engine
from router.fleet import Fleet
from router.lifecycle import Lifecycle
from router.registry import default_registry
from router.settings import Settings

log = logging.getLogger(__name__)

# How long a router's start waits for its first good scrape of every pod, and for one that
# failed its first to answer.
FIRST_SCRAPES_SECONDS = 15.0
FAILING_SECONDS = 2.0


class Router(Lifecycle):
    def __init__(
        self, fleet: Fleet, engine: Engine, tracer: trace.Tracer, redis: RedisLink | None = None
    ) -> None:
        super().__init__(fleet, engine, tracer)
        self.redis = redis  # where the fleet load is published
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    def from_settings(cls, settings: Settings, tracer: trace.Tracer) -> Router:
        engine = Engine(default_registry().build(settings.plugins, settings.profile))
        redis = None if settings.redis is None else RedisLink.of(settings.redis)
        return cls(Fleet(settings.fleet), engine, tracer, redis)

    async def start(self) -> None:
        """Resolve the pods, then keep resolving, scraping and publishing until `stop`; returns
        once every pod has answered a scrape (or failed for a while)."""
        resolver = Resolver(self.fleet)
        self.fleet.set_pods(await resolver.resolve())
        self._tasks = [asyncio.create_task(resolver.run())]
        if self.fleet.settings.collectors == "process":
            self._tasks.append(asyncio.create_task(CollectorProcess(self.fleet).run()))
        else:
            self._tasks.append(asyncio.create_task(Scraper(self.fleet).run()))
            self._tasks.append(asyncio.create_task(kvevents.run(self.fleet)))
        if self.redis is not None:
            self._tasks.append(asyncio.create_task(publisher.run(self.fleet, self.redis)))
        await self._scraped_once(FIRST_SCRAPES_SECONDS)

    async def _scraped_once(self, within: float) -> None:
        """Until every pod has answered a scrape, or every pod has been scraped and failed for
        `FAILING_SECONDS` more (a router that answered before would pick no pod, and Envoy's
        fallback would decide): the collectors' process takes a second or more to start, and a
        first connection may be slow. Bounded: past `within` the router starts anyway."""
        now = time.monotonic()
        deadline, failing_until = now + within, None
        snaps = self.fleet.snapshots
        while not all(snap.ok for snap in snaps.values()):
            now = time.monotonic()
            if failing_until is None and all(snap.at > float("-inf") for snap in snaps.values()):
                failing_until = now + FAILING_SECONDS
            if now >= deadline or (failing_until is not None and now >= failing_until):
                bad = sum(not snap.ok for snap in snaps.values())
                log.warning("starting with pods not scraped well", extra={"pods": bad})
                return
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.redis is not None:
            await self.redis.close()

    def register(self, server: grpc.aio.Server) -> None:
        """The access log that tells the router how each picked request ended."""
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(OutcomeService(self), server)
