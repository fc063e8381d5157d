"""The gRPC adapter: Envoy's ext_proc stream in, the pick out as `envoy.lb` dynamic metadata.

Per request stream: pick on `request_headers` (or on `request_body` when Envoy buffers the body),
answer with `x-gateway-destination-endpoint` = "ip:port,..." best first; count the request in
flight on the first pod until response headers (whose status also feeds pod health; an answer
from another pod, Envoy's `upstream.address`, means Envoy retried because our pick failed) or
the stream's end. When no pod is left the answer carries no metadata and Envoy's fallback picks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf.struct_pb2 import Struct
from opentelemetry import trace
from opentelemetry.context import Context

from llmgw import wire
from llmgw.telemetry import parent_context
from router.engine import Engine, NoPod
from router.fleet import Fleet
from router.request import from_headers, with_body
from router.settings import PickSettings
from router.types import PickRequest, PodId

EXT_PROC_FILTER = "envoy.filters.http.ext_proc"  # key of the attributes Envoy sends


def lb_metadata(pods: tuple[PodId, ...]) -> Struct:
    meta = Struct()
    meta.update({wire.LB_NAMESPACE: {wire.DESTINATION_ENDPOINT: ",".join(pods)}})
    return meta


def header_map(msg: pb.HttpHeaders) -> dict[str, str]:
    return {
        h.key: h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        for h in msg.headers.headers
    }


def upstream_address(msg: pb.ProcessingRequest) -> str | None:
    """The `upstream.address` attribute (the pod that answered), when Envoy sent it."""
    attrs = msg.attributes.get(EXT_PROC_FILTER)
    if attrs is None or "upstream.address" not in attrs.fields:
        return None
    value = attrs.fields["upstream.address"].string_value
    return value or None


class RouterService(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(
        self, fleet: Fleet, engine: Engine, tracer: trace.Tracer, settings: PickSettings
    ) -> None:
        self.fleet = fleet
        self.engine = engine
        self.tracer = tracer
        self.settings = settings

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
        self.fleet.acquire(result.pods[0])
        return lb_metadata(result.pods), result.pods[0]

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext[pb.ProcessingRequest, pb.ProcessingResponse],
    ) -> AsyncIterator[pb.ProcessingResponse]:
        req: PickRequest | None = None
        parent = Context()  # replaced by Envoy's trace with the request headers
        pod: PodId | None = None
        decided = False
        try:
            async for msg in request_iterator:
                kind = msg.WhichOneof("request")
                if kind == "request_headers":
                    headers = header_map(msg.request_headers)
                    req = from_headers(headers)
                    parent = parent_context(context.invocation_metadata(), headers)
                    if self.settings.buffered_body and not msg.request_headers.end_of_stream:
                        yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
                        continue
                    meta, pod = self.decide(req, parent)
                    decided = True
                    yield pb.ProcessingResponse(
                        request_headers=pb.HeadersResponse(), dynamic_metadata=meta
                    )
                elif kind == "request_body":
                    if decided or req is None:
                        yield pb.ProcessingResponse(request_body=pb.BodyResponse())
                        continue
                    req = with_body(req, msg.request_body.body, self.settings.max_prefix_blocks)
                    meta, pod = self.decide(req, parent)
                    decided = True
                    yield pb.ProcessingResponse(
                        request_body=pb.BodyResponse(), dynamic_metadata=meta
                    )
                elif kind == "request_trailers":
                    yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
                elif kind == "response_headers":
                    if pod is not None:
                        status = header_map(msg.response_headers).get(":status", "")
                        answered = upstream_address(msg)
                        if answered and answered != pod:  # Envoy retried: our pick failed
                            self.fleet.report(pod, 503)
                        elif status.isdigit():
                            self.fleet.report(pod, int(status))
                        self.fleet.release(pod)
                        pod = None
                    yield pb.ProcessingResponse(response_headers=pb.HeadersResponse())
                elif kind == "response_body":
                    yield pb.ProcessingResponse(response_body=pb.BodyResponse())
                elif kind == "response_trailers":
                    yield pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
        finally:
            if pod is not None:
                self.fleet.release(pod)
