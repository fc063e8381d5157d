"""A pick's lifecycle, the one every router adapter follows: `choose` (the pods, best first, the
first counted in flight at once), then `hold` (the request goes to it) or `give_back` (it does
not), and `ended` (how the request ended: the hold released, the picked pod's health told, the
plugins that learn taught). The adapters: extauthz's check (extauthz/service.py), the ext_proc
service (router/service.py) and the InferencePool picker (router/picker.py); the outcome comes
from the access log (router/collectors/outcomes.py) or, in the picker, from the response.

What a pick teaches the plugins that learn (the prefix index: this pod now caches this prompt)
is true only once the pod has served the request. Inside extauthz the pick comes before the rate
limiter, so a refused request would teach it a lie, and a tenant over its limit could rewrite
every pod's index for free. So a pick with a request ID is observed when its outcome says a pod
answered it with a 2xx, on that pod.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from opentelemetry import trace
from opentelemetry.context import Context

from llmgw.telemetry import recording
from router import metrics
from router.engine import Engine, NoPod
from router.fleet import Fleet
from router.plugins.not_saturated import NotSaturated
from router.saturation import Bounds
from router.types import Candidate, Pick, PickRequest, PodId

# Picks waiting for their outcome before the plugins learn from them; the oldest are dropped
# (their outcome went to another replica, or was lost). Each holds up to 64 block hashes
# (~2.5 KB): at most ~40 MB.
MAX_UNSERVED = 16_384


class Lifecycle:
    def __init__(self, fleet: Fleet, engine: Engine, tracer: trace.Tracer) -> None:
        self.fleet = fleet
        self.engine = engine
        self.tracer = tracer
        self.recording = recording(tracer)
        self._unserved: OrderedDict[str, PickRequest] = OrderedDict()
        # Told the request ID of every request that ended (flow control: its seat is free).
        self.end_listeners: list[Callable[[str], None]] = []

    @property
    def bounds(self) -> Bounds:
        """Saturation as the pick's not-saturated filter has it (its defaults without one)."""
        for f in self.engine.profile.filters:
            if isinstance(f, NotSaturated):
                return f.bounds
        return Bounds()

    def pick(
        self,
        req: PickRequest,
        parent: Context | None = None,
        subset: frozenset[PodId] | None = None,
    ) -> Pick | None:
        """`choose` and `hold` at once, for an adapter whose request always goes to its pick."""
        chosen = self.choose(req, parent, subset)
        if chosen is not None:
            self.hold(req, chosen)
        return chosen

    def choose(
        self,
        req: PickRequest,
        parent: Context | None = None,
        subset: frozenset[PodId] | None = None,
    ) -> Pick | None:
        """The pods best first (among `subset`, a gateway's hint, if any), the first counted in
        flight at once, so that the choices made meanwhile see it; then `hold` or `give_back`.
        None: no pod."""
        candidates = self.fleet.candidates()
        if req.kv_blocks:
            found = self.fleet.kv.annotate(req.kv_blocks, req.kv_block_size, candidates)
            metrics.KV_LOOKUPS.labels("hit" if found else "miss").inc()
        if subset is not None:
            candidates = [c for c in candidates if c.pod in subset]
        result = (
            self._traced(req, candidates, parent, subset)
            if self.recording
            else self._pick(req, candidates, subset)
        )
        if isinstance(result, NoPod):
            return None
        self.fleet.acquire(result.pods[0], req.request_id)
        return result

    def pin(self, req: PickRequest, pod: PodId) -> Pick | None:
        """The pick of a request that only `pod` can serve (it holds the stored response the
        request names), counted in flight there as a choice is; then `hold` or `give_back`.
        None: the pod is not in the fleet (Envoy's fallback sends it to a pod that answers it
        has no such response)."""
        if pod not in self.fleet.snapshots:
            return None
        self.fleet.acquire(pod, req.request_id)
        return Pick((pod,), "pinned")

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
        self.fleet.withdraw(chosen.pods[0])
        if req.request_id is None:
            self.fleet.release(chosen.pods[0])
        else:
            self.fleet.finish(req.request_id)  # nothing if its time in flight ran out already

    def ended(
        self,
        request_id: str | None,
        answered: PodId | None,
        status: int,
        picked: PodId | None = None,
        at: float | None = None,
    ) -> None:
        """How a request ended: `answered` by that pod (None: by none, e.g. refused before any
        pod) with `status` (0: unknown). Its hold is released: by request ID, or the `picked`
        pod's when the adapter that saw the pick end held it without one. The picked pod's
        health learns how it did, a request Envoy retried on another pod counting as a 503 of
        the picked one; and a pod that answered with a 2xx learns the request, as the pick's
        observers would have (`hold`). `at`: when its last byte left the pod (on the fleet's
        clock), if known."""
        held = self.fleet.finish(request_id) if request_id else None
        if held is not None and answered is not None:  # it ran there: its seat is free now
            self.fleet.ended(held, at)
        if request_id:
            for listener in self.end_listeners:
                listener(request_id)
        if request_id is None and picked is not None:
            self.fleet.release(picked)
        picked = picked or held
        req = self._unserved.pop(request_id, None) if request_id else None
        if req is not None and answered is not None and 200 <= status < 300:
            served = self.fleet.candidate(answered)
            if served is not None:
                self.engine.observe(req, served)
        if picked is None or answered is None:  # not picked here (or long ago), or no reply
            return
        if answered != picked:
            self.fleet.report(picked, 503)
        elif status:
            self.fleet.report(picked, status)

    def _pick(
        self, req: PickRequest, candidates: list[Candidate], subset: frozenset[PodId] | None
    ) -> Pick | NoPod:
        if subset is not None and not candidates:
            return NoPod("subset")  # the gateway's hint left no pod
        return self.engine.pick(req, candidates, observe=False)

    def _traced(
        self,
        req: PickRequest,
        candidates: list[Candidate],
        parent: Context | None,
        subset: frozenset[PodId] | None,
    ) -> Pick | NoPod:
        attributes = {
            k: v for k, v in (("tenant.id", req.tenant), ("session.id", req.session)) if v
        }
        with self.tracer.start_as_current_span(
            "router.pick", context=parent, attributes=attributes
        ) as span:
            result = self._pick(req, candidates, subset)
            if isinstance(result, NoPod):
                span.set_attribute("router.no_pod", result.stage)
            else:
                span.set_attribute("router.pod", result.pods[0])
                span.set_attribute("router.reason", result.reason)
        return result
