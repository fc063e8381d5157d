"""The gRPC adapter: Envoy's CheckRequest in, to the director (extauthz/director.py), and its
`Answer` out as a CheckResponse (extauthz/httpserver.py is the HTTP one)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.auth.v3 import external_auth_pb2, external_auth_pb2_grpc
from google.protobuf import struct_pb2
from google.rpc import code_pb2

from extauthz.answers import Answer
from extauthz.director import Director
from llmgw.facts import MetaValue

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
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


class AuthorizationService(external_auth_pb2_grpc.AuthorizationServicer):  # type: ignore[misc]
    def __init__(self, director: Director) -> None:
        self.director = director

    async def Check(
        self, request: external_auth_pb2.CheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> external_auth_pb2.CheckResponse:
        director = self.director
        http = request.attributes.request.http
        # http.headers is a Mapping already (with the pseudo-headers); decide only reads it.
        carrier = context.invocation_metadata() if director.tracing else ()
        answer = await director.check(http.headers, http.raw_body or http.body.encode(), carrier)
        return check_response(answer)


def register(director: Director) -> Callable[[grpc.aio.Server], None]:
    service = AuthorizationService(director)

    def add(server: grpc.aio.Server) -> None:
        external_auth_pb2_grpc.add_AuthorizationServicer_to_server(service, server)

    return add
