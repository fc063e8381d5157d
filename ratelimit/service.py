"""The gRPC adapter: RateLimitService/ShouldRateLimit in and out of xds-protos messages.

Hot path (one call per request): the response is filled in place (the repeated fields' add,
sub-messages as dicts: half the cost of building each message and copying it in), the
descriptor status names are precomputed, and no span is started when tracing is off.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from google.protobuf import struct_pb2
from opentelemetry import trace

from llmgw import wire
from llmgw.telemetry import parent_context, recording
from ratelimit import metrics
from ratelimit.descriptors import UNITS, Parsed, parse
from ratelimit.limiter import Limiter
from ratelimit.response import admission_metadata, rate_headers, refusal
from ratelimit.types import KindState, Unit, Verdict

Code = rls_pb2.RateLimitResponse.Code
_Response = rls_pb2.RateLimitResponse
_Struct = struct_pb2.Struct
_OK = Code.OK
_TRUE = struct_pb2.Value(bool_value=True)
_DECIDED = struct_pb2.Struct(fields={wire.META_DECIDED: _TRUE})  # the common case, built once
_OVER = Code.OVER_LIMIT
# requests_per_unit and limit_remaining are uint32 on the wire; a larger limit (a token budget
# above 4.29 billion is valid config) is reported as the largest value, the headers carry it whole.
_UINT32_MAX = 2**32 - 1
_NAMES = {
    (kind, unit): f"{kind}_per_{unit.value}" for kind in ("requests", "tokens") for unit in Unit
}


def _status(add: Callable[..., object], state: KindState | None, over: bool) -> None:
    """One DescriptorStatus, added with `add` (the statuses field's)."""
    if state is None or not isinstance(state.unit, Unit):  # a money budget has no RLS unit
        add(code=_OVER if over else _OK)
        return
    reset_ms = state.reset_ms
    add(
        code=_OVER if over else _OK,
        current_limit={
            "name": _NAMES[(state.kind, state.unit)],
            "requests_per_unit": min(state.limit, _UINT32_MAX),
            "unit": UNITS[state.unit],
        },
        limit_remaining=min(state.remaining, _UINT32_MAX),
        duration_until_reset={"seconds": reset_ms // 1000, "nanos": reset_ms % 1000 * 1_000_000},
    )


def to_response(parsed: Parsed, verdict: Verdict | None) -> rls_pb2.RateLimitResponse:
    """One status per descriptor, in order; headers and, on refusal, the 429 body."""
    if verdict is None:
        response = _Response(overall_code=_OK)
        for _ in parsed.roles:
            response.statuses.add(code=_OK)
        return response
    refused = verdict.refusal is not None
    over = verdict.refused.kind if refused and verdict.refused is not None else None
    response = _Response(
        overall_code=_OVER if refused else _OK, dynamic_metadata=_metadata(verdict)
    )
    add = response.statuses.add
    for role in parsed.roles:
        if role == "requests":
            _status(add, verdict.requests, over == "requests")
        elif role == "tokens":
            _status(add, verdict.tokens, over == "tokens" or over == "spend")
        else:
            add(code=_OK)
    header = response.response_headers_to_add.add
    for key, value in rate_headers(verdict):
        header(key=key, value=value)
    if refused:
        extra, response.raw_body = refusal(verdict)
        for key, value in extra:
            header(key=key, value=value)
    return response


def _metadata(verdict: Verdict) -> struct_pb2.Struct:
    fields = admission_metadata(verdict)
    if len(fields) == 1:
        return _DECIDED
    struct = _Struct()
    struct.update(fields)
    return struct


class RateLimitService(rls_pb2_grpc.RateLimitServiceServicer):  # type: ignore[misc]
    def __init__(self, limiter: Limiter, tracer: trace.Tracer) -> None:
        self.limiter = limiter
        self.tracer = tracer
        self.tracing = recording(tracer)

    async def ShouldRateLimit(
        self, request: rls_pb2.RateLimitRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> rls_pb2.RateLimitResponse:
        if self.tracing:
            return await self._traced(request, context)
        started = time.perf_counter()
        parsed = parse(request)
        verdict = None
        if parsed.admission is not None:
            verdict = await self.limiter.admit(parsed.admission)
        response = to_response(parsed, verdict)
        metrics.DECISION_SECONDS.observe(time.perf_counter() - started)
        return response

    async def _traced(
        self, request: rls_pb2.RateLimitRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> rls_pb2.RateLimitResponse:
        started = time.perf_counter()
        parsed = parse(request)
        with self.tracer.start_as_current_span(
            "ratelimit.decide",
            context=parent_context(context.invocation_metadata()),
            kind=trace.SpanKind.SERVER,
        ) as span:
            verdict = None
            if parsed.admission is not None:
                admission = parsed.admission
                span.set_attribute("tenant.id", admission.tenant)
                if admission.session:
                    span.set_attribute("session.id", admission.session)
                verdict = await self.limiter.admit(admission)
                span.set_attribute("llmgw.ratelimit.result", verdict.refusal or "ok")
            response = to_response(parsed, verdict)
        metrics.DECISION_SECONDS.observe(time.perf_counter() - started)
        return response
