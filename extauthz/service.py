"""The check: Envoy's request in, the decision out as an `Answer`, and the gRPC adapter
(CheckRequest in, CheckResponse out; extauthz/httpserver.py is the HTTP one).

With a rate limiter in this process (settings `admit`), an allowed request is admitted here too:
a refusal is the denial (429, or the breaker's 503) with the limiter's body and headers, an
admission adds its x-ratelimit-* headers to the response and what it decided to the metadata
(the ledger and envoy/rewrite.lua read it there). With a router (settings `pick`), the request's
pod is chosen, and counted in flight, while its admission's Redis round trip is under way; it is
named in the metadata (where Envoy's override_host reads it) if the request is admitted, and
given back if not.
Neither needs an exchange of its own. Both fail open: a limiter or router that raises costs
the admission or the pick, not the request (Redis down is the limiter's own degraded mode).

The key is verified from the headers before the body is read (`receive`): a stranger's body is
never parsed, nor over HTTP even received. From then until it is answered, a check holds its
body's bytes in the replica's budget (extauthz/budget.py): past the tenant's share a 429, past
the replica's total a 503, at once.

Hot path (one call per request): no span is started when tracing is off."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.auth.v3 import external_auth_pb2, external_auth_pb2_grpc
from google.protobuf import struct_pb2
from google.rpc import code_pb2
from opentelemetry import trace

from extauthz import metrics
from extauthz.body import Body
from extauthz.body import read as read_body
from extauthz.budget import BodyBudget, Held
from extauthz.decision import Decider, key_entry
from extauthz.store import TenantsStore
from extauthz.types import Allow, Decision, Deny
from extauthz.waits import Waits
from llmgw import authzhttp, wire
from llmgw.facts import MetaValue
from llmgw.telemetry import parent_context, recording
from ratelimit import admission
from ratelimit import metrics as ratelimit_metrics
from ratelimit.response import admission_metadata, rate_headers, refusal, refusal_status
from ratelimit.runtime import RateLimiter
from ratelimit.types import Verdict
from router.request import from_metadata
from router.runtime import Router
from router.types import Pick, PickRequest, endpoints

log = logging.getLogger(__name__)

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_JSON = ("content-type", "application/json")
# Every other denial: PERMISSION_DENIED.
_DENY_GRPC = {
    401: code_pb2.UNAUTHENTICATED,
    429: code_pb2.RESOURCE_EXHAUSTED,
    503: code_pb2.UNAVAILABLE,
}


def _add_headers(
    field: Any,  # RepeatedCompositeFieldContainer[HeaderValueOption]
    headers: Iterable[tuple[str, str]],
) -> None:
    for key, value in headers:
        option = field.add()  # set after: add(**fields) parses its keywords on every call
        option.append_action = _OVERWRITE
        header = option.header
        header.key = key
        header.value = value


def _fill(struct: struct_pb2.Struct, metadata: Mapping[str, MetaValue]) -> None:
    """`struct.update(metadata)` with the common scalars set inline: protobuf's update is pure
    Python, a function call and an isinstance chain per value, and was two thirds of building an
    allowed response. Anything else goes through `Struct.__setitem__`, as update would."""
    fields = struct.fields
    for key, value in metadata.items():
        kind = value.__class__
        if kind is str:
            fields[key].string_value = value
        elif kind is float:
            fields[key].number_value = value
        elif kind is bool:
            fields[key].bool_value = value
        else:
            struct[key] = value


@dataclass(slots=True)
class Answer:
    """extauthz's answer to one check, whichever protocol carries it: gRPC (`check_response`)
    or HTTP (extauthz/httpserver.py)."""

    status: int  # 200: allowed; else the denial's status
    metadata: dict[str, MetaValue]
    client_headers: list[tuple[str, str]]  # allowed: added to the response; denied: the denial's
    headers: Sequence[tuple[str, str]] = ()  # allowed: set on the request to the pod
    headers_to_remove: Sequence[str] = ()
    body: bytes = b""  # denied: the OpenAI error

    @property
    def allowed(self) -> bool:
        return self.status == 200


def denied(deny: Deny) -> Answer:
    return Answer(deny.status, {}, [_JSON, *deny.headers], body=deny.body())


_RETRY_SOON = (("retry-after", "1"),)


def too_many_bodies(tenant: str, share: int) -> Deny:
    return Deny(
        429,
        "too_many_bodies_in_flight",
        f"Tenant {tenant} has more request bodies in flight than its share of {share} bytes "
        "allows. Please retry shortly.",
        type="requests",  # OpenAI's type of a rate limit on requests
        tenant=tenant,
        headers=_RETRY_SOON,
    )


def overloaded(tenant: str | None) -> Deny:
    return Deny(
        503,
        "overloaded",
        "The gateway is overloaded. Please retry shortly.",
        type="server_error",
        tenant=tenant,
        headers=_RETRY_SOON,
    )


def refused(allow: Allow, verdict: Verdict) -> Answer:
    """The limiter's refusal as the denial, as the rate-limit filter would have sent it, with
    the session header every answer carries; and the request's facts in the metadata all the
    same, for the access log (Envoy keeps a denied check's metadata; it adds no headers to the
    request it refuses)."""
    headers, body = refusal(verdict)
    return Answer(
        refusal_status(verdict),
        {**allow.metadata, **admission_metadata(verdict)},
        [*rate_headers(verdict), *headers, *allow.response_headers],
        body=body,
    )


def admitted(allow: Allow, verdict: Verdict | None) -> Answer:
    """The answer to an allowed request: the limiter's refusal, or the allowance with what the
    limiter decided (its headers to the client, its answer in the metadata)."""
    if verdict is not None and verdict.refusal is not None:
        return refused(allow, verdict)
    answer = Answer(
        200,
        dict(allow.metadata),
        list(allow.response_headers),
        allow.headers,
        allow.headers_to_remove,
    )
    if verdict is not None:
        answer.client_headers += rate_headers(verdict)
        answer.metadata.update(admission_metadata(verdict))
    return answer


def check_response(answer: Answer) -> external_auth_pb2.CheckResponse:
    """The answer as gRPC's CheckResponse, filled in place (messages passed to a constructor
    are copied once more)."""
    response = external_auth_pb2.CheckResponse()
    if answer.allowed:
        response.status.SetInParent()  # code OK
        ok = response.ok_response
        ok.SetInParent()
        _add_headers(ok.headers, answer.headers)
        ok.headers_to_remove.extend(answer.headers_to_remove)
        _add_headers(ok.response_headers_to_add, answer.client_headers)
    else:
        response.status.code = _DENY_GRPC.get(answer.status, code_pb2.PERMISSION_DENIED)
        denied = response.denied_response
        denied.status.code = answer.status
        _add_headers(denied.headers, answer.client_headers)
        denied.body = answer.body.decode()
    if answer.metadata:
        # Only here: OkHttpResponse.dynamic_metadata (deprecated) would replace this silently.
        response.dynamic_metadata.SetInParent()
        _fill(response.dynamic_metadata, answer.metadata)
    return response


async def admit(limiter: RateLimiter, allow: Allow, timeout_s: float) -> Verdict | None:
    """The limiter's verdict on an allowed request, within `timeout_s`; None: not decided, and
    the request goes on unchecked, as Envoy's rate-limit filter fails open (counted here, and by
    the ledger). The budget bounds the admission however slow Redis is (a borrowing admission
    makes up to three round trips, each within the store's own deadline), so that it stays
    inside Envoy's wait for this Check, which fails closed."""
    started = time.perf_counter()
    try:
        request = admission.from_metadata(allow.metadata)
        if request is None:
            return None
        async with asyncio.timeout(timeout_s):
            verdict = await limiter.limiter.admit(request)
    except TimeoutError:
        log.warning("admission over its budget: admitted unchecked", extra={"tenant": allow.tenant})
        metrics.admit_errors("timeout").inc()
        return None
    except Exception:  # a limiter bug costs the admission, never the request
        log.exception("admission failed", extra={"tenant": allow.tenant})
        metrics.admit_errors("error").inc()
        return None
    ratelimit_metrics.DECISION_SECONDS.observe(time.perf_counter() - started)
    return verdict


# A request's pick before it is held: what the router was asked, and its answer.
Chosen = tuple[PickRequest, Pick]


def choose(router: Router, allow: Allow) -> Chosen | None:
    """The router's pods for this request, best first, the first counting it in flight until
    `hold` or `give_back` (the request ID in the facts is Envoy's x-request-id, which its access
    log carries too); None: Envoy's fallback picks."""
    try:
        request = from_metadata(allow.metadata)
        pick = router.choose(request)
    except Exception:  # a router bug costs the pick (Envoy's fallback picks), never the request
        _pick_failed(allow)
        return None
    return None if pick is None else (request, pick)


def hold(router: Router, answer: Answer, allow: Allow, chosen: Chosen) -> None:
    """The request goes to the chosen pods: into the answer's metadata."""
    request, pick = chosen
    try:
        router.hold(request, pick)
    except Exception:  # as in `choose`
        _pick_failed(allow)
        return
    answer.metadata[wire.DESTINATION_ENDPOINT] = endpoints(pick.pods)


def give_back(router: Router, allow: Allow, chosen: Chosen) -> None:
    """The request does not go to the chosen pod (refused, or its check abandoned)."""
    try:
        router.give_back(*chosen)
    except Exception:  # as in `choose`
        _pick_failed(allow)


def _pick_failed(allow: Allow) -> None:
    log.exception("pick failed", extra={"tenant": allow.tenant})
    metrics.PICK_ERRORS.inc()


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with(parent: int) -> None:
    """A pool worker's first act: SIGTERM when the process that started it dies, however it
    dies (SIGKILL included), so no worker outlives extauthz; and gone now if it already has."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        os._exit(0)


class PoolDown(Exception):
    """The body pool read no body: its worker died under it twice, or no new one starts."""


class BodyPool:
    """Large bodies are read in a worker process, so that one tenant's megabytes of JSON never
    hold the event loop that decides everyone's requests (`json.loads` holds the GIL: a thread
    would not help). Small ones are read inline: the hop costs more than they do.

    A worker that dies (killed, out of memory) breaks its whole executor: it is replaced at once,
    and unhealthy only while no replacement can be made."""

    def __init__(self, decider: Decider, from_bytes: int, workers: int = 1) -> None:
        self.decider = decider
        self.from_bytes = from_bytes
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = self._new_executor()

    def _new_executor(self) -> ProcessPoolExecutor:
        # spawn, not fork: this process runs gRPC's threads.
        context = multiprocessing.get_context("spawn")
        return ProcessPoolExecutor(
            self.workers, mp_context=context, initializer=_die_with, initargs=(os.getpid(),)
        )

    @property
    def healthy(self) -> bool:
        return self._pool is not None

    async def start(self) -> None:
        """Start the workers now, not on the first large body."""
        await self._run(b"{}")

    async def read(self, body: bytes) -> Body | None:
        """The body read in a worker if it is large, else None (the decision reads it)."""
        if len(body) < self.from_bytes:
            return None
        metrics.POOLED_BODIES.inc()
        return await self._run(body)

    async def _run(self, body: bytes) -> Body:
        """The body read in a worker; on a broken pool, once more on its replacement (not
        twice: the body may be what killed it)."""
        loop = asyncio.get_running_loop()
        for _ in range(2):
            pool = self._pool or self._replace(None)
            if pool is None:
                break
            try:
                return await loop.run_in_executor(pool, read_body, body, self.decider.settings)
            except (BrokenProcessPool, OSError):  # OSError: a worker could not be started
                self._replace(pool)
        raise PoolDown

    def _replace(self, broken: ProcessPoolExecutor | None) -> ProcessPoolExecutor | None:
        """A new pool for `broken`, unless another check replaced it already; None if none
        can be made (tried again on the next large body)."""
        if self._pool is not broken:
            return self._pool
        if broken is not None:
            # Not cancel_futures: its pending bodies fail as broken and are read again or
            # answered; cancelled, their checks would end unanswered.
            broken.shutdown(wait=False)
        try:
            self._pool = self._new_executor()
        except Exception:
            log.exception("body pool not replaced")
            self._pool = None
            return None
        log.warning("body pool replaced: its worker died")
        metrics.POOL_RESTARTS.inc()
        return self._pool

    async def close(self) -> None:
        """Stop the workers and wait until they have exited (a worker mid-body finishes it)."""
        if self._pool is not None:
            await asyncio.to_thread(self._pool.shutdown, wait=True, cancel_futures=True)


class AuthorizationService(external_auth_pb2_grpc.AuthorizationServicer):  # type: ignore[misc]
    def __init__(
        self,
        store: TenantsStore,
        decider: Decider,
        tracer: trace.Tracer,
        clock: Callable[[], float] = time.time,
        bodies: BodyPool | None = None,
        router: Router | None = None,
        limiter: RateLimiter | None = None,
        admit_timeout_s: float = 1.0,
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
        self.budget = BodyBudget(
            decider.settings.body_bytes_in_flight, decider.settings.tenant_body_bytes_in_flight
        )

    @property
    def healthy(self) -> bool:
        """False while the body pool is broken beyond replacement (health checks fail)."""
        return self.bodies is None or self.bodies.healthy

    async def respond(self, decision: Decision) -> Answer:
        if not isinstance(decision, Allow):
            return denied(decision)
        router, limiter = self.router, self.limiter
        if limiter is None:
            answer = admitted(decision, None)
            if router is not None and (picked := choose(router, decision)) is not None:
                hold(router, answer, decision, picked)
            return answer
        if router is None:
            return self.answer(decision, await admit(limiter, decision, self.admit_timeout_s))
        # The admission's round trip to Redis leaves first and the pod is chosen while it is
        # under way (Redis on another core or host works meanwhile). The choice counts in flight
        # at once, so that the checks answered meanwhile spread over the pods; the request goes
        # to it only if admitted, else it is given back: a refused request holds no pod and
        # teaches the router nothing.
        admission = asyncio.get_running_loop().create_task(
            admit(limiter, decision, self.admit_timeout_s)
        )
        chosen: Chosen | None = None
        try:
            await asyncio.sleep(0)  # the admission runs to its wait for Redis: its command sent
            chosen = choose(router, decision)
            answer = self.answer(decision, await admission)
            if answer.allowed and chosen is not None:
                hold(router, answer, decision, chosen)
                chosen = None
            return answer
        finally:
            admission.cancel()  # this check was cancelled (Envoy gave up on it); else a no-op
            if chosen is not None:
                give_back(router, decision, chosen)

    def answer(self, allow: Allow, verdict: Verdict | None) -> Answer:
        """The answer to an allowed request with the limiter's verdict (None: unchecked)."""
        if self.tracing:  # the span of the check, current while it runs
            result = "unchecked" if verdict is None else verdict.refusal or "ok"
            trace.get_current_span().set_attribute("llmgw.ratelimit.result", result)
        try:
            return admitted(allow, verdict)
        except Exception:  # a bug in the limiter's answer costs it, never the request
            log.exception("admission answer failed", extra={"tenant": allow.tenant})
            metrics.admit_errors("error").inc()
            return admitted(allow, None)

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
        """A check's head: its key verified and its body's declared `length` held for its
        tenant until the check is answered; or the denial, before any of the body is read."""
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
            span.set_attribute("session.id", decision.session)
            if decision.model is not None:
                span.set_attribute("llm.request.model", decision.model)
        else:
            span.set_attribute("http.response.status_code", decision.status)
        span.set_attribute("llmgw.decision", result)
        if tenant:
            span.set_attribute("tenant.id", tenant)

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
        try:
            parsed = await self.bodies.read(body) if self.bodies is not None else None
        except PoolDown:
            return self.refuse(overloaded(held.tenant))
        started = time.perf_counter()
        decision = self.decider.decide(self.store.current, headers, body, self.clock(), parsed)
        metrics.DECISION_SECONDS.observe(time.perf_counter() - started)
        self.count(decision)
        return await self.respond(decision)

    async def Check(
        self, request: external_auth_pb2.CheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> external_auth_pb2.CheckResponse:
        http = request.attributes.request.http
        # http.headers is a Mapping already (with the pseudo-headers); decide only reads it.
        carrier = context.invocation_metadata() if self.tracing else ()
        answer = await self.check(http.headers, http.raw_body or http.body.encode(), carrier)
        return check_response(answer)


def register(service: AuthorizationService) -> Callable[[grpc.aio.Server], None]:
    def add(server: grpc.aio.Server) -> None:
        external_auth_pb2_grpc.add_AuthorizationServicer_to_server(service, server)

    return add
