"""The ext_proc adapter: Envoy's ext_proc stream in, the pick out as `envoy.lb` dynamic metadata.

Per request one ext_proc message: the request headers with extauthz's metadata (tenant context and
request facts). The answer carries `x-gateway-destination-endpoint` = "ip:port,..." best first
and counts the request in flight on the first pod (router/lifecycle.py). When no pod is left the
answer carries no metadata and Envoy's fallback picks. The outcome comes later, batched, from the
access log (router/collectors/outcomes.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf.struct_pb2 import Struct
from opentelemetry.context import Context

from llmgw import wire
from llmgw.structs import View
from llmgw.telemetry import parent_context
from router.lifecycle import Lifecycle
from router.request import from_headers, from_metadata
from router.types import PodId, endpoints


def lb_metadata(pods: tuple[PodId, ...]) -> Struct:
    meta = Struct()  # set in place: `Struct.update` goes through Python per value
    lb = meta.fields[wire.LB_NAMESPACE].struct_value
    lb.fields[wire.DESTINATION_ENDPOINT].string_value = endpoints(pods)
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
    def __init__(self, router: Lifecycle) -> None:
        self.router = router

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext[pb.ProcessingRequest, pb.ProcessingResponse],
    ) -> AsyncIterator[pb.ProcessingResponse]:
        recording = self.router.recording
        async for msg in request_iterator:
            kind = msg.WhichOneof("request")
            if kind == "request_headers":
                authz = authz_metadata(msg)
                parent: Context | None = None
                # Envoy's x-request-id names the request in the access log too.
                if authz and not recording:  # only the request ID is read: decode no other
                    rid = header(msg.request_headers, wire.HEADER_REQUEST_ID)
                    req = from_metadata(authz, rid)
                else:
                    headers = header_map(msg.request_headers)
                    rid = headers.get(wire.HEADER_REQUEST_ID)
                    req = from_metadata(authz, rid) if authz else from_headers(headers)
                    if recording:
                        parent = parent_context(context.invocation_metadata(), headers)
                chosen = self.router.pick(req, parent)
                yield (
                    NO_PICK
                    if chosen is None
                    else pb.ProcessingResponse(
                        request_headers=EMPTY_HEADERS, dynamic_metadata=lb_metadata(chosen.pods)
                    )
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
