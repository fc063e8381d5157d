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

from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf.struct_pb2 import Struct
from opentelemetry import trace
from opentelemetry.context import Context

from llmgw import wire
from llmgw.structs import to_dict
from llmgw.telemetry import parent_context
from router.engine import Engine, NoPod
from router.fleet import Fleet
from router.request import from_headers, from_metadata
from router.types import PickRequest, PodId


def lb_metadata(pods: tuple[PodId, ...]) -> Struct:
    meta = Struct()
    meta.update({wire.LB_NAMESPACE: {wire.DESTINATION_ENDPOINT: ",".join(pods)}})
    return meta


def header_map(msg: pb.HttpHeaders) -> dict[str, str]:
    return {
        h.key: h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        for h in msg.headers.headers
    }


def authz_metadata(msg: pb.ProcessingRequest) -> dict[str, Any]:
    """extauthz's namespace as Envoy forwarded it; {} when absent (no extauthz in front)."""
    found = msg.metadata_context.filter_metadata.get(wire.EXTAUTHZ_NAMESPACE)
    return to_dict(found) if found is not None else {}


class RouterService(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, fleet: Fleet, engine: Engine, tracer: trace.Tracer) -> None:
        self.fleet = fleet
        self.engine = engine
        self.tracer = tracer

    def decide(self, req: PickRequest, parent: Context) -> tuple[Struct | None, PodId | None]:
        attributes = {
            k: v for k, v in (("tenant.id", req.tenant), ("session.id", req.session)) if v
        }
        with self.tracer.start_as_current_span(
            "router.pick", context=parent, attributes=attributes
        ) as span:
            result = self.engine.pick(req, self.fleet.candidates())
            if isinstance(result, NoPod):
                span.set_attribute("router.no_pod", result.stage)
                return None, None
            span.set_attribute("router.pod", result.pods[0])
            span.set_attribute("router.reason", result.reason)
        self.fleet.acquire(result.pods[0], req.request_id)
        return lb_metadata(result.pods), result.pods[0]

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext[pb.ProcessingRequest, pb.ProcessingResponse],
    ) -> AsyncIterator[pb.ProcessingResponse]:
        async for msg in request_iterator:
            kind = msg.WhichOneof("request")
            if kind == "request_headers":
                headers = header_map(msg.request_headers)
                parent = parent_context(context.invocation_metadata(), headers)
                authz = authz_metadata(msg)
                # Envoy's x-request-id names the request in the access log too.
                rid = headers.get(wire.HEADER_REQUEST_ID)
                req = from_metadata(authz, rid) if authz else from_headers(headers)
                meta, _ = self.decide(req, parent)
                yield pb.ProcessingResponse(
                    request_headers=pb.HeadersResponse(), dynamic_metadata=meta
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
