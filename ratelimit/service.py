"""The gRPC adapter: RateLimitService/ShouldRateLimit in and out of xds-protos messages."""

from __future__ import annotations

import time

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from google.protobuf import duration_pb2
from opentelemetry import trace

from llmgw.telemetry import parent_context
from ratelimit import metrics
from ratelimit.descriptors import UNITS, Parsed, parse
from ratelimit.limiter import Limiter
from ratelimit.response import rate_headers, refusal
from ratelimit.types import KindState, Verdict

Code = rls_pb2.RateLimitResponse.Code


def _status(state: KindState | None, over: bool) -> rls_pb2.RateLimitResponse.DescriptorStatus:
    status = rls_pb2.RateLimitResponse.DescriptorStatus(code=Code.OVER_LIMIT if over else Code.OK)
    if state is not None:
        status.current_limit.CopyFrom(
            rls_pb2.RateLimitResponse.RateLimit(
                name=f"{state.kind}_per_{state.unit.value}",
                requests_per_unit=state.limit,
                unit=UNITS[state.unit],
            )
        )
        status.limit_remaining = state.remaining
        status.duration_until_reset.CopyFrom(
            duration_pb2.Duration(
                seconds=state.reset_ms // 1000, nanos=state.reset_ms % 1000 * 1_000_000
            )
        )
    return status


def _header(name: str, value: str) -> base_pb2.HeaderValue:
    return base_pb2.HeaderValue(key=name, value=value)


def to_response(parsed: Parsed, verdict: Verdict | None) -> rls_pb2.RateLimitResponse:
    """One status per descriptor, in order; headers and, on refusal, the 429 body."""
    refused = verdict is not None and verdict.refusal is not None
    response = rls_pb2.RateLimitResponse(overall_code=Code.OVER_LIMIT if refused else Code.OK)
    for role in parsed.roles:
        if verdict is None or role not in ("requests", "tokens"):
            response.statuses.append(_status(None, False))
            continue
        state = verdict.requests if role == "requests" else verdict.tokens
        over = refused and (verdict.refusal == "requests") == (role == "requests")
        response.statuses.append(_status(state, over))
    if verdict is not None:
        headers = rate_headers(verdict)
        if verdict.refusal is not None:
            extra, body = refusal(verdict)
            headers += extra
            response.raw_body = body
        response.response_headers_to_add.extend(_header(k, v) for k, v in headers)
    return response


class RateLimitService(rls_pb2_grpc.RateLimitServiceServicer):  # type: ignore[misc]
    def __init__(self, limiter: Limiter, tracer: trace.Tracer) -> None:
        self.limiter = limiter
        self.tracer = tracer

    async def ShouldRateLimit(
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
