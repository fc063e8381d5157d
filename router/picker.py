"""The router as a Gateway API Inference Extension endpoint picker (EPP) for any conformant
gateway (Envoy Gateway, Istio, kgateway, GKE): docs/inference-pool.md.

The protocol (gateway-api-inference-extension, docs/proposals/004-endpoint-picker-protocol):
- ext_proc, the body mode read from the first message's `protocol_config`:
  FULL_DUPLEX_STREAMED (what the reference picker's gateways configure): nothing is answered
  until the end of the body (at most `max_body_bytes`, else a 413); then the headers' answer
  with the pick, then the whole body back as streamed chunks. BUFFERED (and STREAMED, where
  Envoy may have picked before the body ends): the headers' answer is empty, the pick rides on
  the last body chunk's answer (headers not yet sent upstream). NONE, or headers that end the
  request: picked at the headers.
- The pick goes out twice with one value, best first: the request header
  `x-gateway-destination-endpoint` and dynamic metadata `envoy.lb` /
  `x-gateway-destination-endpoint`, "ip:port,ip:port,...".
- A subset hint (`envoy.lb.subset_hint` / `x-gateway-destination-endpoint-subset`, a list of
  ip:port) restricts the pick to those pods; nothing eligible (or an empty list) is an
  ImmediateResponse 503, as is an empty fleet: a gateway has no fallback pick of its own.
- The served endpoint (`envoy.lb` / `x-gateway-destination-endpoint-served`, in the response
  headers' metadata) and the status end the pick as an access-log entry would
  (router/lifecycle.py `ended`): at the response headers or, failing those, when the stream ends.

With llmgw's extauthz in front, its tenant context (forwarded metadata) steers the pick as in
llmgw's own Envoy; without it, the model and prompt prefix come from the body.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2

from llmgw import facts, structs, wire
from llmgw.telemetry import parent_context
from router.lifecycle import Lifecycle
from router.request import from_headers, from_metadata
from router.service import authz_metadata, header_map, lb_metadata
from router.settings import InferencePoolSettings
from router.types import Pick, PickRequest, PodId, endpoints

NONE = pm.ProcessingMode.NONE
FULL_DUPLEX = pm.ProcessingMode.FULL_DUPLEX_STREAMED
BODY_CHUNK = 62_000  # bytes per streamed body answer, as the reference picker sends them
NO_POD = "No model server can take this request now; please retry."
# The picker's health services, beside the server's own ("").
HEALTH_SERVICES = ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")


def subset_hint(msg: pb.ProcessingRequest) -> frozenset[PodId] | None:
    """The gateway's subset of eligible pods, or None when it sent none."""
    found = msg.metadata_context.filter_metadata.get(wire.SUBSET_HINT_NAMESPACE)
    if found is None or wire.SUBSET_HINT_KEY not in found.fields:
        return None
    value = structs.value(found.fields[wire.SUBSET_HINT_KEY])
    items = value if isinstance(value, list) else [value]
    return frozenset(str(i) for i in items if isinstance(i, str) and i)


def served_endpoint(msg: pb.ProcessingRequest) -> PodId | None:
    found = msg.metadata_context.filter_metadata.get(wire.LB_NAMESPACE)
    if found is None or wire.SERVED_ENDPOINT not in found.fields:
        return None
    return found.fields[wire.SERVED_ENDPOINT].string_value.split(",", 1)[0] or None


def from_body(body: bytes, settings: InferencePoolSettings, session: str | None) -> PickRequest:
    """Model and prompt prefix from an OpenAI body (nothing when it is not JSON), and the
    client's `x-session-id` for affinity."""
    try:
        request = json.loads(body) if body else None
    except ValueError:
        request = None
    if not isinstance(request, dict):
        return PickRequest(session=session)
    model = request.get("model")
    found = facts.from_body(
        request,
        chars_per_token=facts.CHARS_PER_TOKEN,
        image_tokens=0,
        max_output=0,
        max_blocks=settings.max_prefix_blocks,
        model=model if isinstance(model, str) and model else None,
    )
    return PickRequest(
        model=found.model,
        session=session,
        prefix_blocks=found.prefix_blocks,
        prompt_tokens=found.prompt_tokens,
        first_turn=found.first_turn,
    )


def immediate(status: int, message: str, kind: str, code: str | None) -> pb.ProcessingResponse:
    """An answer in OpenAI's error shape, instead of the upstream's."""
    body = {"error": {"message": message, "type": kind, "code": code, "param": None}}
    content_type = base_pb2.HeaderValue(key="content-type", raw_value=b"application/json")
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=pb.HeaderMutation(
                set_headers=[base_pb2.HeaderValueOption(header=content_type)]
            ),
            body=json.dumps(body).encode(),
            details=f"llmgw_router_{status}",
        )
    )


def unavailable(message: str) -> pb.ProcessingResponse:
    """No eligible pod: 503, as the protocol requires (a gateway has no fallback pick)."""
    return immediate(503, message, "server_error", "server_is_overloaded")


def too_large(limit: int) -> pb.ProcessingResponse:
    return immediate(
        413,
        f"Request body too large: the limit is {limit} bytes.",
        "invalid_request_error",
        "request_too_large",
    )


def destination(pods: tuple[PodId, ...]) -> pb.CommonResponse:
    """The pick as a request header, the same value as the `envoy.lb` metadata."""
    value = endpoints(pods).encode()
    header = base_pb2.HeaderValue(key=wire.DESTINATION_ENDPOINT, raw_value=value)
    return pb.CommonResponse(
        header_mutation=pb.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(header=header)]),
        clear_route_cache=True,
    )


def streamed_body(body: bytes) -> list[pb.ProcessingResponse]:
    """The body sent back in full-duplex mode, in chunks of the reference picker's size."""
    chunks = [body[i : i + BODY_CHUNK] for i in range(0, len(body), BODY_CHUNK)] or [b""]
    return [
        pb.ProcessingResponse(
            request_body=pb.BodyResponse(
                response=pb.CommonResponse(
                    body_mutation=pb.BodyMutation(
                        streamed_response=pb.StreamedBodyResponse(
                            body=chunk, end_of_stream=i == len(chunks) - 1
                        )
                    )
                )
            )
        )
        for i, chunk in enumerate(chunks)
    ]


class InferencePoolService(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, router: Lifecycle, settings: InferencePoolSettings) -> None:
        self.router = router
        self.settings = settings

    def pick(
        self, req: PickRequest, subset: frozenset[PodId] | None, headers: dict[str, str], ctx: Any
    ) -> Pick | None:
        """The pods best first, the first one now counted in flight; None: no pod."""
        recording = self.router.recording
        parent = parent_context(ctx.invocation_metadata(), headers) if recording else None
        return self.router.pick(req, parent, subset)

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext[pb.ProcessingRequest, pb.ProcessingResponse],
    ) -> AsyncIterator[pb.ProcessingResponse]:
        mode = NONE  # the gateway's request body mode (protocol_config, first message)
        headers: dict[str, str] = {}
        authz: Mapping[str, Any] = {}
        subset: frozenset[PodId] | None = None
        body = bytearray()
        waiting = False  # the pick waits for the end of the body
        held: tuple[PickRequest, PodId] | None = None  # the request, and its pod until it ends
        try:
            async for msg in request_iterator:
                if msg.HasField("protocol_config"):
                    mode = msg.protocol_config.request_body_mode
                kind = msg.WhichOneof("request")
                if kind == "request_headers":
                    headers = header_map(msg.request_headers)
                    authz = authz_metadata(msg)
                    subset = subset_hint(msg)
                    if msg.request_headers.end_of_stream or mode == NONE:
                        req = self._request(authz, headers, b"")
                        chosen = self.pick(req, subset, headers, context)
                        if chosen is None:
                            yield unavailable(NO_POD)
                            return
                        held = (req, chosen.pods[0])
                        yield pb.ProcessingResponse(
                            request_headers=pb.HeadersResponse(response=destination(chosen.pods)),
                            dynamic_metadata=lb_metadata(chosen.pods),
                        )
                        continue
                    waiting = True
                    if mode != FULL_DUPLEX:  # Envoy waits for this answer before the body
                        yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
                elif kind == "request_body":
                    chunk = msg.request_body
                    if waiting and len(body) + len(chunk.body) > self.settings.max_body_bytes:
                        yield too_large(self.settings.max_body_bytes)
                        return
                    if waiting:
                        body += chunk.body
                    if not (waiting and chunk.end_of_stream):
                        if mode != FULL_DUPLEX:  # full duplex: the body goes back at the end
                            yield pb.ProcessingResponse(request_body=pb.BodyResponse())
                        continue
                    waiting = False
                    req = self._request(authz, headers, bytes(body))
                    chosen = self.pick(req, subset, headers, context)
                    if chosen is None:
                        yield unavailable(NO_POD)
                        return
                    held = (req, chosen.pods[0])
                    if mode == FULL_DUPLEX:
                        yield pb.ProcessingResponse(
                            request_headers=pb.HeadersResponse(response=destination(chosen.pods)),
                            dynamic_metadata=lb_metadata(chosen.pods),
                        )
                        for answer in streamed_body(bytes(body)):
                            yield answer
                    else:  # buffered: headers not sent upstream yet, the body's answer sets them
                        yield pb.ProcessingResponse(
                            request_body=pb.BodyResponse(response=destination(chosen.pods)),
                            dynamic_metadata=lb_metadata(chosen.pods),
                        )
                elif kind == "response_headers":
                    if held is not None:
                        self._ended(held, served_endpoint(msg), header_map(msg.response_headers))
                        held = None
                    yield pb.ProcessingResponse(response_headers=pb.HeadersResponse())
                elif kind == "request_trailers":
                    yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
                elif kind == "response_body":
                    yield pb.ProcessingResponse(response_body=pb.BodyResponse())
                elif kind == "response_trailers":
                    yield pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
        finally:
            if held is not None:  # no response headers seen: the request ended some other way
                req, pod = held
                self.router.ended(req.request_id, None, 0, pod)

    def _request(
        self, authz: Mapping[str, Any], headers: dict[str, str], body: bytes
    ) -> PickRequest:
        if authz:
            return from_metadata(authz)
        return from_body(body, self.settings, from_headers(headers).session)

    def _ended(
        self, held: tuple[PickRequest, PodId], served: PodId | None, headers: dict[str, str]
    ) -> None:
        """The response headers: the gateway names the pod that served (else it is taken to be
        our first), and the status is the pod's."""
        req, pod = held
        try:
            status = int(headers.get(":status", "0"))
        except ValueError:
            status = 0
        self.router.ended(req.request_id, served or pod, status, pod)
