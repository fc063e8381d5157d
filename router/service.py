"""The gRPC adapters: Envoy's ext_proc stream in, the pick out as `envoy.lb` dynamic metadata;
Envoy's access log in, each request's outcome back to the fleet.

Per request one ext_proc message: the request headers with extauthz's metadata (tenant context and
request facts). The answer carries `x-gateway-destination-endpoint` = "ip:port,..." best first
and counts the request in flight on the first pod. When no pod is left the answer carries no
metadata and Envoy's fallback picks. The outcome comes later, batched, from the access log: the
picked pod's count in flight drops, and its status feeds pod health (an answer from another pod
means Envoy retried because our pick failed).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf.struct_pb2 import Struct
from opentelemetry import trace
from opentelemetry.context import Context

from llmgw import wire
from llmgw.structs import View
from llmgw.telemetry import parent_context, recording
from router.engine import Engine, NoPod
from router.fleet import Fleet
from router.request import from_headers, from_metadata
from router.types import Candidate, Pick, PickRequest, PodId


def lb_metadata(pods: tuple[PodId, ...]) -> Struct:
    meta = Struct()  # set in place: `Struct.update` goes through Python per value
    lb = meta.fields[wire.LB_NAMESPACE].struct_value
    lb.fields[wire.DESTINATION_ENDPOINT].string_value = ",".join(pods)
    return meta


def header_value(h: base_pb2.HeaderValue) -> str:
    text: str = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return text


def header_map(msg: pb.HttpHeaders) -> dict[str, str]:
    return {h.key: header_value(h) for h in msg.headers.headers}


def header(msg: pb.HttpHeaders, name: str) -> str | None:
    """One header as `header_map(msg).get(name)` reads it (the last of repeated ones), without
    decoding the others."""
    found = None
    for h in msg.headers.headers:
        if h.key == name:
            found = h
    return header_value(found) if found is not None else None


def authz_metadata(msg: pb.ProcessingRequest) -> Mapping[str, Any]:
    """extauthz's namespace as Envoy forwarded it, values converted as they are read; {} when
    absent (no extauthz in front)."""
    found = msg.metadata_context.filter_metadata.get(wire.EXTAUTHZ_NAMESPACE)
    return View(found) if found is not None else {}


# Answers without a pick, built once (grpc serializes what is yielded; nothing mutates these).
NO_PICK = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
EMPTY_HEADERS = pb.HeadersResponse()


class RouterService(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, fleet: Fleet, engine: Engine, tracer: trace.Tracer) -> None:
        self.fleet = fleet
        self.engine = engine
        self.tracer = tracer
        self.recording = recording(tracer)

    def decide(
        self, req: PickRequest, parent: Context | None
    ) -> tuple[Struct | None, PodId | None]:
        candidates = self.fleet.candidates()
        result = (
            self._traced(req, candidates, parent)
            if self.recording
            else self.engine.pick(req, candidates)
        )
        if isinstance(result, NoPod):
            return None, None
        self.fleet.acquire(result.pods[0], req.request_id)
        return lb_metadata(result.pods), result.pods[0]

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

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext[pb.ProcessingRequest, pb.ProcessingResponse],
    ) -> AsyncIterator[pb.ProcessingResponse]:
        async for msg in request_iterator:
            kind = msg.WhichOneof("request")
            if kind == "request_headers":
                authz = authz_metadata(msg)
                parent: Context | None = None
                # Envoy's x-request-id names the request in the access log too.
                if authz and not self.recording:  # only the request ID is read: decode no other
                    rid = header(msg.request_headers, wire.HEADER_REQUEST_ID)
                    req = from_metadata(authz, rid)
                else:
                    headers = header_map(msg.request_headers)
                    rid = headers.get(wire.HEADER_REQUEST_ID)
                    req = from_metadata(authz, rid) if authz else from_headers(headers)
                    if self.recording:
                        parent = parent_context(context.invocation_metadata(), headers)
                meta, _ = self.decide(req, parent)
                yield (
                    NO_PICK
                    if meta is None
                    else pb.ProcessingResponse(request_headers=EMPTY_HEADERS, dynamic_metadata=meta)
                )
            # Envoy sends nothing else in this processing mode; answer anything anyway.
            elif kind == "request_body":
                yield pb.ProcessingResponse(request_body=pb.BodyResponse())
            elif kind == "request_trailers":
                yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
            elif kind == "response_headers":
                yield pb.ProcessingResponse(response_headers=pb.HeadersResponse())
            elif kind == "response_body":
                yield pb.ProcessingResponse(response_body=pb.BodyResponse())
            elif kind == "response_trailers":
                yield pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


def answered_by(entry: accesslog_pb2.HTTPAccessLogEntry) -> PodId | None:
    """The pod that answered, None when none did."""
    sock = entry.common_properties.upstream_remote_address.socket_address
    return f"{sock.address}:{sock.port_value}" if sock.address else None


class OutcomeService(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    """The router's access log: each picked request's end (by request ID, Envoy's x-request-id)
    releases its pod and reports how the pod did (a retry elsewhere counts as a 503 of the picked
    pod). A pick Envoy never used (the client left during the pick) ends by its TTL."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    async def StreamAccessLogs(
        self,
        request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> als_pb2.StreamAccessLogsResponse:
        async for message in request_iterator:
            for entry in message.http_logs.log_entry:
                picked = self.fleet.finish(entry.request.request_id)
                if picked is None:  # not picked by this replica (or long ago)
                    continue
                answered = answered_by(entry)
                status = entry.response.response_code.value
                if answered is not None and answered != picked:
                    self.fleet.report(picked, 503)
                elif answered is not None and status:
                    self.fleet.report(picked, status)
        return als_pb2.StreamAccessLogsResponse()
