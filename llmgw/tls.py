"""Mutual TLS on the services' ports: only Envoy reports outcomes, asks for checks or picks.

A client without a certificate of our CA (plaintext, no certificate, another CA's) fails the
handshake; grpc does not surface that to the server, so it is not counted (the HTTP check port
logs it). A client with one of the CA's certificates that is not Envoy's is refused per call
(PERMISSION_DENIED) and counted in `llmgw_refused_peers_total{method}`: the call's handler never
runs, so a forged access-log batch changes nothing. Certificates: tools/certs.py.
"""

from __future__ import annotations

import inspect
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeAlias

import grpc
from prometheus_client import Counter

from llmgw.config import Strict

ENVOY_IDENTITY = "envoy"  # Envoy's client certificate: its common name and its one SAN
HEALTH_PREFIX = "/grpc.health.v1.Health/"  # anyone may ask (probes; the plaintext port)

REFUSED = Counter(
    "llmgw_refused_peers",
    "Calls refused: a client certificate of our CA that is not Envoy's",
    ["method"],
)


class TlsSettings(Strict):
    cert: Path  # this service's certificate (PEM)
    key: Path
    ca: Path  # the CA a client's certificate must chain to
    peer: str = ENVOY_IDENTITY  # the SAN a client's certificate must carry


def server_credentials(tls: TlsSettings) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials(
        [(tls.key.read_bytes(), tls.cert.read_bytes())],
        root_certificates=tls.ca.read_bytes(),
        require_client_auth=True,
    )


def server_context(tls: TlsSettings) -> ssl.SSLContext:
    """For a raw asyncio server (the HTTP check port): a client certificate of the CA required."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=tls.ca)
    context.load_cert_chain(tls.cert, tls.key)
    context.verify_mode = ssl.CERT_REQUIRED
    return context


Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


class OnlyPeer(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Every call but health runs only for a client certificate carrying `peer` as a SAN."""

    def __init__(self, peer: str) -> None:
        self.peer = peer.encode()

    def allows(self, context: Context) -> bool:
        return self.peer in context.auth_context().get("x509_subject_alternative_name", ())

    async def refuse(self, method: str, context: Context) -> None:
        REFUSED.labels(method).inc()
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, "only Envoy may call this port")

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method: str = details.method
        if handler is None or method.startswith(HEALTH_PREFIX):
            return handler
        kind = ("stream_" if handler.request_streaming else "unary_") + (
            "stream" if handler.response_streaming else "unary"
        )
        inner = getattr(handler, kind)
        if inspect.isasyncgenfunction(inner):  # a streamed answer: ext_proc's Process

            async def streamed(request: Any, context: Context) -> AsyncIterator[Any]:
                if not self.allows(context):
                    await self.refuse(method, context)
                async for reply in inner(request, context):
                    yield reply

            behavior: Callable[..., Any] = streamed
        else:

            async def answered(request: Any, context: Context) -> Any:
                if not self.allows(context):
                    await self.refuse(method, context)
                return await inner(request, context)

            behavior = answered
        make = getattr(grpc, f"{kind}_rpc_method_handler")
        return make(
            behavior,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
