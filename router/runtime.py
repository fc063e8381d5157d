"""The router as a part any process can hold: the fleet (membership, scrapes, the fleet-load
publisher), the engine, and the pick that counts a request in flight.

`python -m router` serves it behind ext_proc (router/service.py, router/picker.py); extauthz holds
one to pick inside its own Check, which saves the request path a gRPC exchange (extauthz/pick.py).
Either way the outcomes come back on the access log (router/service.py OutcomeService).
"""

from __future__ import annotations

import asyncio

import grpc
from envoy.service.accesslog.v3 import als_pb2_grpc
from opentelemetry import trace
from opentelemetry.context import Context

from llmgw.link import RedisLink
from llmgw.telemetry import recording
from router.engine import Engine, NoPod
from router.fleet import Fleet
from router.outcomes import OutcomeService
from router.registry import default_registry
from router.settings import Settings, redis_address
from router.types import Candidate, Pick, PickRequest, PodId


class Router:
    def __init__(self, fleet: Fleet, engine: Engine, tracer: trace.Tracer) -> None:
        self.fleet = fleet
        self.engine = engine
        self.tracer = tracer
        self.recording = recording(tracer)
        self._tasks: list[asyncio.Task[None]] = []
        self._redis: RedisLink | None = None

    @classmethod
    def from_settings(cls, settings: Settings, tracer: trace.Tracer) -> Router:
        engine = Engine(default_registry().build(settings.plugins, settings.profile))
        router = cls(Fleet(settings.fleet), engine, tracer)
        if settings.redis_url is not None:
            host, port, password = redis_address(settings.redis_url)
            router._redis = RedisLink(
                host,
                port,
                settings.fleet.publish_interval,
                password,
                cluster=settings.redis_cluster,
            )
        return router

    async def start(self) -> None:
        """Resolve the pods, then keep resolving, scraping and publishing until `stop`."""
        fleet = self.fleet
        fleet.set_pods(await fleet.resolve())
        self._tasks = [
            asyncio.create_task(fleet.run_resolver()),
            asyncio.create_task(fleet.run_scrapes()),
        ]
        if self._redis is not None:
            self._tasks.append(asyncio.create_task(fleet.run_publisher(self._redis)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._redis is not None:
            await self._redis.close()

    def register(self, server: grpc.aio.Server) -> None:
        """The access log that tells the fleet how each picked request ended."""
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(OutcomeService(self.fleet), server)

    def pick(self, req: PickRequest, parent: Context | None = None) -> tuple[PodId, ...] | None:
        """The pods best first, the first counted in flight; None: no pod (Envoy's fallback)."""
        candidates = self.fleet.candidates()
        result = (
            self._traced(req, candidates, parent)
            if self.recording
            else self.engine.pick(req, candidates)
        )
        if isinstance(result, NoPod):
            return None
        self.fleet.acquire(result.pods[0], req.request_id)
        return result.pods

    def _traced(
        self, req: PickRequest, candidates: list[Candidate], parent: Context | None
    ) -> Pick | NoPod:
        attributes = {
            k: v for k, v in (("tenant.id", req.tenant), ("session.id", req.session)) if v
        }
        with self.tracer.start_as_current_span(
            "router.pick", context=parent, attributes=attributes
        ) as span:
            result = self.engine.pick(req, candidates)
            if isinstance(result, NoPod):
                span.set_attribute("router.no_pod", result.stage)
            else:
                span.set_attribute("router.pod", result.pods[0])
                span.set_attribute("router.reason", result.reason)
        return result
