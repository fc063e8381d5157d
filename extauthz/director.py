"""The director: one check's stages, sequenced here and nowhere else (as llm-d's request-control
director sequences admission, scheduling and pre-request), whichever protocol asked (gRPC:
extauthz/service.py, HTTP: extauthz/httpserver.py).

1. authenticate (`receive`): the key, verified from the headers before the body is read (a
   stranger's body is never parsed, nor over HTTP even received); from then until it is answered
   the check holds its body's bytes in the replica's budget (extauthz/budget.py): past the
   tenant's share a 429, past the replica's total a 503, at once.
2. decide: the body read (a large one in the body pool) and the decision (extauthz/decision.py):
   a denial, or the typed request (extauthz/context.py) that the next stages fill in. With a
   router, a model no pod serves is answered here, as vLLM would (404), from its view of the
   fleet (a set lookup; the fleet's list not known yet: the pod answers).
3. admit: with a rate limiter in this process (settings `admit`), the request's admission; a
   refusal is the denial (429, or the breaker's 503) with the limiter's body and headers.
4. queue: with flow control (extauthz/flow.py, the router inside), a request for which no pod
   has a seat free waits, admitted, until one frees for it, or is refused (429 queue_full,
   queue_timeout); one that need not wait goes on as below, to the pods with a seat free.
5. pick: with a router (settings `pick`), the request's pods, chosen and counted in flight while
   the admission's Redis round trip is under way (or at the queue's dispatch).
6. hold: an admitted request goes to its pods; a refused or abandoned one gives them back.
7. answer: the typed request written for Envoy, once (extauthz/answers.py): the limiter's
   x-ratelimit-* headers to the client, what it decided, the pods and the queue's wait in the
   metadata (the ledger, envoy/rewrite.lua and Envoy's override_host read it there).

Neither admit nor pick needs an exchange of its own. Both fail open: a limiter or router that
raises costs the admission or the pick, not the request (Redis down is the limiter's own degraded
mode).

Hot path (one call per request): no span is started when tracing is off."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from functools import partial

from opentelemetry import trace

from extauthz import metrics
from extauthz.answers import (
    Answer,
    admitted,
    denied,
    model_not_found,
    overloaded,
    picked,
    queue_refused,
    queued,
    stored,
    too_many_bodies,
)
from extauthz.bodypool import BodyPool, PoolDown
from extauthz.budget import BodyBudget, Held
from extauthz.context import RequestContext, Timings
from extauthz.decision import Decider, key_entry, request_path
from extauthz.flow import FlowControl, Refused
from extauthz.queue import Waiter
from extauthz.responseids import Kept
from extauthz.store import TenantsSource
from extauthz.types import Allow, Decision, Deny
from extauthz.waits import Waits
from llmgw import authzhttp, wire
from llmgw.telemetry import parent_context, recording
from ratelimit import admission
from ratelimit import metrics as ratelimit_metrics
from ratelimit.runtime import RateLimiter
from router.request import from_context
from router.runtime import Router
from router.types import PodId

DEFAULT_BAND = 5  # a tenant without a priority (the tenants file's default)

log = logging.getLogger(__name__)


class Director:
    def __init__(
        self,
        store: TenantsSource,
        decider: Decider,
        tracer: trace.Tracer,
        clock: Callable[[], float] = time.time,
        bodies: BodyPool | None = None,
        router: Router | None = None,
        limiter: RateLimiter | None = None,
        admit_timeout_s: float = 1.0,
        flow: FlowControl | None = None,
    ) -> None:
        self.store = store
        self.decider = decider
        self.tracer = tracer
        self.clock = clock
        self.tracing = recording(tracer)
        self.bodies = bodies
        self.waits = Waits()
        self.router = router
        self.limiter = limiter
        self.admit_timeout_s = admit_timeout_s
        self.flow = flow
        self._releases: set[asyncio.Task[bool]] = set()  # referenced until done
        self.budget = BodyBudget(
            decider.settings.body_bytes_in_flight, decider.settings.tenant_body_bytes_in_flight
        )

    @property
    def healthy(self) -> bool:
        """False while the body pool is broken beyond replacement (health checks fail)."""
        return self.bodies is None or self.bodies.healthy

    async def check(
        self,
        headers: Mapping[str, str],
        body: bytes,
        carrier: Iterable[tuple[str, str | bytes]] = (),
        held: Held | None = None,
    ) -> Answer:
        """One check: `headers` with lower-case names and the pseudo-headers `:method` and
        `:path`; `carrier`, the call's own trace context (gRPC metadata), if any; `held`, the
        body's bytes if `receive` held them already (over HTTP, from the head on)."""
        if not self.tracing:
            return await self._check(headers, body, held)
        with self.tracer.start_as_current_span(
            "extauthz.check",
            context=parent_context(carrier, headers),
            kind=trace.SpanKind.SERVER,
        ):
            return await self._check(headers, body, held)

    async def _check(self, headers: Mapping[str, str], body: bytes, held: Held | None) -> Answer:
        if held is None:
            received = self.receive(headers, len(body))
            if isinstance(received, Answer):
                return received
            try:
                return await self._check(headers, body, received)
            finally:
                received.release()
        request = await self.decide(headers, body, held)
        if isinstance(request, Answer):
            return request
        return await self.direct(request)

    def key(self, headers: Mapping[str, str]) -> Answer:
        """Whose key the headers present (authzhttp.KEY_PATH): the tenant, or the refusal.
        Envoy asks at a request's headers, before it buffers any of the body, and caches the
        answer briefly: a stranger's upload is refused before it is read."""
        if self._late(headers):  # the question waited (a burst's): Envoy sees it stamped
            return self.refuse(overloaded(None))
        entry = key_entry(self.store.current, headers, self.clock())
        if isinstance(entry, Deny):
            return self.refuse(entry)
        return Answer(200, {}, [(wire.HEADER_TENANT, entry.tenant.id)])

    def receive(self, headers: Mapping[str, str], length: int) -> Answer | Held:
        """Authenticate: a check's head, its key verified and its body's declared `length` held
        for its tenant until the check is answered; or the denial, before any of the body is
        read."""
        if self._late(headers):
            return self.refuse(overloaded(None))
        key = key_entry(self.store.current, headers, self.clock())
        if isinstance(key, Deny):
            return self.refuse(key)
        tenant = key.tenant.id
        held = self.budget.take(tenant, length)
        if isinstance(held, Held):
            return held
        if held == "tenant":
            return self.refuse(too_many_bodies(tenant, self.budget.per_tenant))
        return self.refuse(overloaded(tenant))

    def _late(self, headers: Mapping[str, str]) -> bool:
        """The check has waited (in Envoy's queue for this server, and in this one) since Envoy
        stamped it so long that Envoy would give up on it before the answer: shed now, with an
        answer the client can act on (503 overloaded, retry-after), at no cost to anyone's
        quota, rather than Envoy's timeout later (extauthz/waits.py: net of the clocks' offset)."""
        stamp = headers.get(authzhttp.BODY_AT)
        if stamp is None or not stamp.isdigit():
            return False
        waited = self.waits.waited_ms(int(stamp), self.clock() * 1000)
        return waited is not None and waited >= self.decider.settings.shed_after_ms

    async def decide(
        self, headers: Mapping[str, str], body: bytes, held: Held
    ) -> RequestContext | Answer:
        """The body read and the request decided: the typed request, or the denial."""
        try:
            path = request_path(headers)
            parsed = await self.bodies.read(body, path) if self.bodies is not None else None
        except PoolDown:
            return self.refuse(overloaded(held.tenant))
        started = time.perf_counter()
        decision = self.decider.decide(self.store.current, headers, body, self.clock(), parsed)
        took = time.perf_counter() - started
        metrics.DECISION_SECONDS.observe(took)
        if isinstance(decision, Allow) and (unknown := self.unknown_model(headers, decision)):
            metrics.decisions("model_not_found", decision.tenant).inc()
            return unknown
        self.count(decision)
        if isinstance(decision, Deny):
            return denied(decision)
        return RequestContext(decision, Timings(decide=took), len(body))

    def unknown_model(self, headers: Mapping[str, str], allow: Allow) -> Answer | None:
        """vLLM's 404 for a generation request naming a model the fleet does not serve, with
        the models the tenant may use among those it does; None: served, or not known."""
        model, router = allow.facts.model, self.router
        path = request_path(headers)
        if router is None or model is None or path not in wire.GENERATION_PATHS:
            return None
        served = router.fleet.served_models()
        if served is None or model in served:
            return None
        tenant = self.store.current.tenants.get(allow.tenant)
        allowed = None if tenant is None else tenant.models
        return model_not_found(allow, served if allowed is None else served & allowed)

    async def direct(self, request: RequestContext) -> Answer:
        """Admit, pick, hold and answer an allowed request; through flow control when it holds
        the request's model."""
        router, limiter, flow = self.router, self.limiter, self.flow
        model = request.facts.model
        if router is not None and flow is not None and model is not None:
            return await self.flowed(flow, router, request, model)
        if router is None:
            if limiter is not None:
                await self.admit(limiter, request)
            return self.answer(request)
        return await self.go(router, request)

    async def go(
        self, router: Router, request: RequestContext, free: frozenset[PodId] | None = None
    ) -> Answer:
        """Admit and pick (among the `free` pods, if any) at once. The admission's round trip to
        Redis leaves first and the pod is chosen while it is under way (Redis on another core or
        host works meanwhile). The choice counts in flight at once, so that the checks answered
        meanwhile spread over the pods; the request goes to it only if admitted, else it is
        given back: a refused request holds no pod and teaches the router nothing."""
        limiter = self.limiter
        if limiter is None:
            answer = self.answer(request)
            self.pick(router, request, free)
            self.hold(router, request, answer)
            return answer
        admitting = asyncio.get_running_loop().create_task(self.admit(limiter, request))
        try:
            await asyncio.sleep(0)  # the admission runs to its wait for Redis: its command sent
            self.pick(router, request, free)
            await admitting
            answer = self.answer(request)
            if answer.allowed:
                self.hold(router, request, answer)
            return answer
        finally:
            admitting.cancel()  # this check was cancelled (Envoy gave up on it); else a no-op
            self.give_back(router, request)

    async def flowed(
        self, flow: FlowControl, router: Router, request: RequestContext, model: str
    ) -> Answer:
        """Flow control's stage: at once to a pod with a seat free for it, or admitted, queued
        until one frees for it (picked then) and answered; or refused from the queue."""
        context = request.context
        band = context.priority or DEFAULT_BAND
        tokens = request.facts.token_estimate
        free = flow.free_for(model, context.tenant)
        if free is not None:
            answer = await self.go(router, request, free.pods)
            if answer.allowed:
                flow.dispatched(model, band, context.tenant, context.request_id, tokens)
                self.queued(answer, 0.0, free.soon)
            return answer
        if self.limiter is not None:
            await self.admit(self.limiter, request)
            verdict = request.verdict
            if verdict is not None and verdict.refusal is not None:
                return self.answer(request)
        waiter = Waiter(
            context.tenant,
            band,
            tokens,
            request.body_bytes,
            time.monotonic(),
            partial(self.pick, router, request),
            context.request_id,
        )
        tier = self.store.current.tiers.tier(context.tier)
        try:
            waited = await flow.wait(
                waiter, model, min(tier.queue_timeout_s, flow.settings.max_wait_s)
            )
            if isinstance(waited, Refused):
                refused = queue_refused(
                    request.allow, request.verdict, waited.code, waited.retry_after_s
                )
                self.queued(refused, time.monotonic() - waiter.at, False)  # the ledger releases it
                return refused
            answer = self.answer(request)
            if answer.allowed:
                self.hold(router, request, answer)
                self.queued(answer, waited, True)
            return answer
        except asyncio.CancelledError:
            self.release(request)
            raise
        finally:
            if request.chosen is not None:  # dispatched, but it does not go (its check is gone)
                flow.ended(context.request_id)
            self.give_back(router, request)

    def release(self, request: RequestContext) -> None:
        """The client left while its admitted request waited: its reservation given back now
        (Envoy logs the request without the check's metadata, so the ledger cannot)."""
        verdict, limiter = request.verdict, self.limiter
        if limiter is None or verdict is None or verdict.refusal is not None:
            return
        context = request.context
        task = asyncio.get_running_loop().create_task(
            limiter.release(context.tenant, context.request_id)
        )
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    def queued(self, answer: Answer, waited_s: float, soon: bool) -> None:
        queued(answer, waited_s, soon)
        if self.tracing:
            trace.get_current_span().set_attribute("llmgw.queue_ms", round(waited_s * 1000))

    async def admit(self, limiter: RateLimiter, request: RequestContext) -> None:
        """The limiter's verdict on the request, within `admit_timeout_s`; none: not decided,
        and the request goes on unchecked, as Envoy's rate-limit filter fails open (counted
        here, and by the ledger). The budget bounds the admission however slow Redis is (a
        borrowing admission makes up to three round trips, each within the store's own
        deadline), so that it stays inside Envoy's wait for this Check, which fails closed."""
        started = time.perf_counter()
        try:
            request.admission = admission.from_context(request.context, request.facts)
            async with asyncio.timeout(self.admit_timeout_s):
                verdict = await limiter.limiter.admit(request.admission)
        except TimeoutError:
            log.warning(
                "admission over its budget: admitted unchecked",
                extra={"tenant": request.context.tenant},
            )
            metrics.admit_errors("timeout").inc()
            return
        except Exception:  # a limiter bug costs the admission, never the request
            log.exception("admission failed", extra={"tenant": request.context.tenant})
            metrics.admit_errors("error").inc()
            return
        request.verdict = verdict
        request.timings.admit = time.perf_counter() - started
        ratelimit_metrics.DECISION_SECONDS.observe(request.timings.admit)

    def pick(
        self, router: Router, request: RequestContext, free: frozenset[PodId] | None = None
    ) -> None:
        """The router's pods for the request (among the `free` ones, if any: flow control's),
        best first, the first counting it in flight until `hold` or `give_back` (the request ID
        is Envoy's x-request-id, which its access log carries too); none: Envoy's fallback
        picks."""
        try:
            asked = from_context(request.context, request.facts)
            pinned = request.allow.pinned
            if pinned is not None:
                pick = router.pin(asked, pinned)
            else:
                pick = router.choose(asked, subset=free or None)
        except Exception:  # a router bug costs the pick (Envoy's fallback picks), never the request
            self._pick_failed(request)
            return
        if pick is not None:
            request.chosen = (asked, pick)

    def hold(self, router: Router, request: RequestContext, answer: Answer) -> None:
        """The request goes to the chosen pods: into the answer."""
        if request.chosen is None:
            return
        (asked, pick), request.chosen = request.chosen, None
        try:
            router.hold(asked, pick)
        except Exception:  # as in `pick`
            self._pick_failed(request)
            return
        request.pods = pick.pods
        picked(answer, pick.pods)
        if request.allow.stores:
            facts = request.facts
            # The conversation the pod keeps under this ID: at most what it was given and may
            # generate (a follow-up bounds its own history by it).
            tokens = facts.history + facts.prompt_ceiling + facts.max_output * facts.n
            kept = Kept(pick.pods[0], tokens)
            stored(answer, self.decider.response_ids.mint(request.context.tenant, kept))

    def give_back(self, router: Router, request: RequestContext) -> None:
        """The request does not go to the chosen pods (refused, or its check abandoned)."""
        if request.chosen is None:
            return
        chosen, request.chosen = request.chosen, None
        try:
            router.give_back(*chosen)
        except Exception:  # as in `pick`
            self._pick_failed(request)

    def _pick_failed(self, request: RequestContext) -> None:
        log.exception("pick failed", extra={"tenant": request.context.tenant})
        metrics.PICK_ERRORS.inc()

    def answer(self, request: RequestContext) -> Answer:
        """The answer to an allowed request with the limiter's verdict (None: unchecked)."""
        verdict = request.verdict
        if self.tracing:  # the span of the check, current while it runs
            result = "unchecked" if verdict is None else verdict.refusal or "ok"
            trace.get_current_span().set_attribute("llmgw.ratelimit.result", result)
        try:
            return admitted(request.allow, verdict)
        except Exception:  # a bug in the limiter's answer costs it, never the request
            log.exception("admission answer failed", extra={"tenant": request.context.tenant})
            metrics.admit_errors("error").inc()
            return admitted(request.allow, None)

    def refuse(self, deny: Deny) -> Answer:
        self.count(deny)
        return denied(deny)

    def count(self, decision: Decision) -> None:
        """The decision in the metrics, and on the check's span when tracing."""
        if isinstance(decision, Allow):
            result, tenant = "allow", decision.tenant
        else:
            result, tenant = decision.code, decision.tenant or ""
        metrics.decisions(result, tenant).inc()
        if not self.tracing:
            return
        span = trace.get_current_span()
        if isinstance(decision, Allow):
            span.set_attribute("session.id", decision.context.session)
            if decision.facts.model is not None:
                span.set_attribute("llm.request.model", decision.facts.model)
        else:
            span.set_attribute("http.response.status_code", decision.status)
        span.set_attribute("llmgw.decision", result)
        if tenant:
            span.set_attribute("tenant.id", tenant)
