"""The gRPC adapter: Envoy's CheckRequest in, the decision out as a CheckResponse."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.auth.v3 import external_auth_pb2, external_auth_pb2_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from google.rpc import code_pb2, status_pb2
from opentelemetry import trace

from extauthz import metrics
from extauthz.decision import Decider
from extauthz.store import TenantsStore
from extauthz.types import Allow, Decision
from llmgw.facts import MetaValue
from llmgw.telemetry import parent_context

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_JSON = base_pb2.HeaderValueOption(
    header=base_pb2.HeaderValue(key="content-type", value="application/json"),
    append_action=_OVERWRITE,
)
_DENY_GRPC = {401: code_pb2.UNAUTHENTICATED}  # every other denial: PERMISSION_DENIED


def _header_options(headers: Iterable[tuple[str, str]]) -> list[base_pb2.HeaderValueOption]:
    return [
        base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=key, value=value), append_action=_OVERWRITE
        )
        for key, value in headers
    ]


def _struct(values: Mapping[str, MetaValue]) -> struct_pb2.Struct:
    out = struct_pb2.Struct()
    out.update(values)
    return out


def to_response(decision: Decision) -> external_auth_pb2.CheckResponse:
    if isinstance(decision, Allow):
        return external_auth_pb2.CheckResponse(
            status=status_pb2.Status(code=code_pb2.OK),
            ok_response=external_auth_pb2.OkHttpResponse(
                headers=_header_options(decision.headers),
                headers_to_remove=decision.headers_to_remove,
                response_headers_to_add=_header_options(decision.response_headers),
            ),
            # Only here: OkHttpResponse.dynamic_metadata (deprecated) would replace this silently.
            dynamic_metadata=_struct(decision.metadata),
        )
    return external_auth_pb2.CheckResponse(
        status=status_pb2.Status(code=_DENY_GRPC.get(decision.status, code_pb2.PERMISSION_DENIED)),
        denied_response=external_auth_pb2.DeniedHttpResponse(
            status=http_status_pb2.HttpStatus(code=decision.status),
            headers=[_JSON],
            body=decision.body().decode(),
        ),
    )


class AuthorizationService(external_auth_pb2_grpc.AuthorizationServicer):  # type: ignore[misc]
    def __init__(
        self,
        store: TenantsStore,
        decider: Decider,
        tracer: trace.Tracer,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.decider = decider
        self.tracer = tracer
        self.clock = clock

    async def Check(
        self, request: external_auth_pb2.CheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> external_auth_pb2.CheckResponse:
        http = request.attributes.request.http
        headers = dict(http.headers)
        body = http.raw_body or http.body.encode()
        with self.tracer.start_as_current_span(
            "extauthz.check",
            context=parent_context(context.invocation_metadata(), headers),
            kind=trace.SpanKind.SERVER,
        ) as span:
            started = time.perf_counter()
            decision = self.decider.decide(self.store.current, headers, body, self.clock())
            metrics.DECISION_SECONDS.observe(time.perf_counter() - started)
            if isinstance(decision, Allow):
                result, tenant = "allow", decision.tenant
                span.set_attribute("session.id", decision.session)
                if decision.model is not None:
                    span.set_attribute("llm.request.model", decision.model)
            else:
                result, tenant = decision.code, decision.tenant or ""
                span.set_attribute("http.response.status_code", decision.status)
            metrics.DECISIONS.labels(result=result, tenant=tenant).inc()
            span.set_attribute("llmgw.decision", result)
            if tenant:
                span.set_attribute("tenant.id", tenant)
            return to_response(decision)


def register(service: AuthorizationService) -> Callable[[grpc.aio.Server], None]:
    def add(server: grpc.aio.Server) -> None:
        external_auth_pb2_grpc.add_AuthorizationServicer_to_server(service, server)

    return add
