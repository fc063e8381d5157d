"""The router as a part any process can hold: the fleet (membership, scrapes, the fleet-load
publisher), the engine, and the pick that counts a request in flight.

`python -m router` serves it behind ext_proc (router/service.py, router/picker.py); extauthz holds
one to pick inside its own Check, which saves the request path a gRPC exchange
(extauthz/service.py). Either way the outcomes come back on the access log (router/outcomes.py).

What a pick teaches the plugins that learn (the prefix index: this pod now caches this prompt)
is true only once the pod has served the request. Inside extauthz the pick comes before the rate
limiter, so a refused request would teach it a lie, and a tenant over its limit could rewrite
every pod's index for free. So a pick with a request ID is observed when its outcome says a pod
answered it (`served`), on that pod.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

import grpc
from envoy.service.accesslog.v3 import als_pb2_grpc
from opentelemetry import trace
from opentelemetry.context import Context

from llmgw.link import RedisLink
from llmgw.telemetry import recording
from router import metrics
from router.engine import Engine, NoPod
from router.fleet import Fleet
from router.outcomes import OutcomeService
from router.registry import default_registry
from router.settings import Settings, redis_address
from router.types import Candidate, Pick, PickRequest, PodId

# Picks waiting for their outcome before the plugins learn from them; the oldest are dropped
# (their outcome went to another replica, or was lost). Each holds up to 64 block hashes
# (~2.5 KB): at most ~40 MB.
MAX_UNSERVED = 16_384


class Router:
    def __init__(
        self, fleet: Fleet, engine: Engine, tracer: trace.Tracer, redis: RedisLink | None = None
    ) -> None:
        self.fleet = fleet
        self.engine = engine
        self.tracer = tracer
        self.recording = recording(tracer)
        self.redis = redis  # where the fleet load is published
        self._tasks: list[asyncio.Task[None]] = []
        self._unserved: OrderedDict[str, PickRequest] = OrderedDict()

    @classmethod
    def from_settings(cls, settings: Settings, tracer: trace.Tracer) -> Router:
        engine = Engine(default_registry().build(settings.plugins, settings.profile))
        redis = None
        if settings.redis_url is not None:
            host, port, password = redis_address(settings.redis_url)
            redis = RedisLink(
                host,
                port,
                settings.redis_connect_timeout_s,
                password,
                cluster=settings.redis_cluster,
            )
        return cls(Fleet(settings.fleet), engine, tracer, redis)

    async def start(self) -> None:
        """Resolve the pods, then keep resolving, scraping and publishing until `stop`."""
        fleet = self.fleet
        fleet.set_pods(await fleet.resolve())
        self._tasks = [
            asyncio.create_task(fleet.run_resolver()),
            asyncio.create_task(fleet.run_scrapes()),
        ]
        if self.redis is not None:
            self._tasks.append(asyncio.create_task(fleet.run_publisher(self.redis)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.redis is not None:
            await self.redis.close()

    def register(self, server: grpc.aio.Server) -> None:
        """The access log that tells the router how each picked request ended."""
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(OutcomeService(self), server)

    def pick(self, req: PickRequest, parent: Context | None = None) -> tuple[PodId, ...] | None:
        """The pods best first, the first held in flight; None: no pod (Envoy's fallback)."""
        chosen = self.choose(req, parent)
        if chosen is None:
            return None
        self.hold(req, chosen)
        return chosen.pods

    def choose(self, req: PickRequest, parent: Context | None = None) -> Pick | None:
        """The pods best first, the first counted in flight at once, so that the choices made
        meanwhile see it; then `hold` (the request goes to it) or `give_back` (it does not:
        extauthz chooses while the request's admission is under way). None: no pod."""
        candidates = self.fleet.candidates()
        result = (
            self._traced(req, candidates, parent)
            if self.recording
            else self.engine.pick(req, candidates, observe=False)
        )
        if isinstance(result, NoPod):
            return None
        self.fleet.acquire(result.pods[0], req.request_id)
        return result

    def hold(self, req: PickRequest, chosen: Pick) -> None:
        """The request goes to the chosen pod: the pick counts as answered, and the plugins
        learn it once a pod has served it (`ended`: with a request ID), else now."""
        pod = chosen.pods[0]
        metrics.picks(pod, chosen.reason).inc()
        if req.request_id is None:
            candidate = self.fleet.candidate(pod)
            if candidate is not None:
                self.engine.observe(req, candidate)
            return
        self._unserved[req.request_id] = req
        if len(self._unserved) > MAX_UNSERVED:
            self._unserved.popitem(last=False)

    def give_back(self, req: PickRequest, chosen: Pick) -> None:
        """The request will not go to the chosen pod (refused, or its check abandoned): it no
        longer counts in flight there, and nothing learns from it."""
        if req.request_id is None:
            self.fleet.release(chosen.pods[0])
        else:
            self.fleet.finish(req.request_id)  # nothing if its time in flight ran out already

    def ended(self, request_id: str, served_by: PodId | None) -> None:
        """The request's outcome: `served_by` the pod that answered it well (None: none did,
        e.g. refused before any pod), which learns it as the pick's observers would have."""
        req = self._unserved.pop(request_id, None)
        if req is None or served_by is None:
            return
        chosen = self.fleet.candidate(served_by)
        if chosen is not None:
            self.engine.observe(req, chosen)

    def _traced(
        self, req: PickRequest, candidates: list[Candidate], parent: Context | None
    ) -> Pick | NoPod:
        attributes = {
            k: v for k, v in (("tenant.id", req.tenant), ("session.id", req.session)) if v
        }
        with self.tracer.start_as_current_span(
            "router.pick", context=parent, attributes=attributes
        ) as span:
            result = self.engine.pick(req, candidates, observe=False)
            if isinstance(result, NoPod):
                span.set_attribute("router.no_pod", result.stage)
            else:
                span.set_attribute("router.pod", result.pods[0])
                span.set_attribute("router.reason", result.reason)
        return result
