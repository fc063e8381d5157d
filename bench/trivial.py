"""Trivial handlers for Envoy's callouts and its access logs: the floor of the design.

One grpc.aio process on uvloop (llmgw.serve, like the real services) that answers ext_authz OK
with fixed request facts and a fixed pick in metadata (so Envoy builds the same rate-limit
descriptors and routes by the pick, as with the router inside extauthz), every rate-limit call OK,
the ext_proc request-headers message (when Envoy makes one: the router apart) with the same pick
in `envoy.lb`, and reads and drops every access-log batch. With `--http-port`, the same check
answer over HTTP too (Envoy's ext_authz `http_service`, llmgw/authzhttp.py), from extauthz's own
HTTP server (extauthz/httpserver.py). Nothing is decided, nothing is stored:
what is left is the gRPC plumbing of the callouts. With `--check-delay-ms`, each ext_authz Check
is answered only after that idle wait (no CPU): the floor run at a slower configuration's rate,
where every process wakes for fewer requests at a time (bench/cpu.py).

    python -m bench.trivial --port 9001 --pick 127.0.0.1:9000 [--http-port 9011]
        [--check-delay-ms 30]
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any

import grpc
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.auth.v3 import external_auth_pb2, external_auth_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from google.protobuf import struct_pb2
from google.rpc import code_pb2, status_pb2

from extauthz.answers import Answer
from extauthz.budget import BodyBudget, Held
from extauthz.httpserver import HttpCheckServer
from llmgw import wire
from llmgw.serve import ServeSettings, run, serve

# What extauthz publishes for a plain request (llmgw/facts.py), fixed.
FACTS: dict[str, Any] = {
    wire.META_TENANT: "bench",
    wire.META_TIER: "platinum",
    wire.META_PRIORITY: 9.0,
    wire.META_SESSION: "sess_bench",
    wire.META_REQUEST_ID: "bench",
    wire.META_KEY_ID: "bench",
    wire.META_MODEL: "meta-llama/Llama-3.1-8B-Instruct",
    wire.META_TOKEN_ESTIMATE: "28",
    wire.META_PROMPT_ESTIMATE: 20.0,
    wire.META_STREAM: False,
    wire.META_INCLUDE_USAGE: False,
    wire.META_CHOICES: 1.0,
    wire.META_MAX_OUTPUT: 8.0,
    wire.META_FIRST_TURN: True,
    wire.META_PREFIX_BLOCKS: "",
    wire.META_DECIDED: True,  # the admission's answer, with the rate limiter inside extauthz
}


def _struct(values: dict[str, Any]) -> struct_pb2.Struct:
    out = struct_pb2.Struct()
    out.update(values)
    return out


class Auth(external_auth_pb2_grpc.AuthorizationServicer):  # type: ignore[misc]
    def __init__(self, pick: str, delay_s: float) -> None:
        self.delay_s = delay_s
        self.reply = external_auth_pb2.CheckResponse(
            status=status_pb2.Status(code=code_pb2.OK),
            ok_response=external_auth_pb2.OkHttpResponse(),
            dynamic_metadata=_struct({**FACTS, wire.DESTINATION_ENDPOINT: pick}),
        )

    async def Check(
        self, request: external_auth_pb2.CheckRequest, context: Any
    ) -> external_auth_pb2.CheckResponse:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return self.reply


class RateLimit(rls_pb2_grpc.RateLimitServiceServicer):  # type: ignore[misc]
    REPLY = rls_pb2.RateLimitResponse(overall_code=rls_pb2.RateLimitResponse.OK)

    async def ShouldRateLimit(
        self, request: rls_pb2.RateLimitRequest, context: Any
    ) -> rls_pb2.RateLimitResponse:
        return self.REPLY


class Pick(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, pick: str) -> None:
        meta = _struct({wire.LB_NAMESPACE: {wire.DESTINATION_ENDPOINT: pick}})
        self.headers = ep.ProcessingResponse(
            request_headers=ep.HeadersResponse(), dynamic_metadata=meta
        )

    async def Process(
        self, request_iterator: AsyncIterator[ep.ProcessingRequest], context: Any
    ) -> AsyncIterator[ep.ProcessingResponse]:
        async for msg in request_iterator:
            if msg.WhichOneof("request") == "request_headers":
                yield self.headers
            else:  # not sent in headers-only mode
                yield ep.ProcessingResponse()


class Logs(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    async def StreamAccessLogs(
        self, request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage], context: Any
    ) -> als_pb2.StreamAccessLogsResponse:
        async for _ in request_iterator:
            pass
        return als_pb2.StreamAccessLogsResponse()


class HttpCheck:
    """The check over HTTP, served by extauthz's own server (extauthz/httpserver.py): the fixed
    answer, after `delay_s`."""

    def __init__(self, pick: str, delay_s: float) -> None:
        self.delay_s = delay_s
        self.metadata = {**FACTS, wire.DESTINATION_ENDPOINT: pick}

    healthy = True

    def receive(self, headers: Mapping[str, str], length: int) -> Answer | Held:
        return Held(BodyBudget(0, 0), "", 0)  # nothing held: the fixed answer reads no body

    def key(self, headers: Mapping[str, str]) -> Answer:
        return Answer(200, {}, [(wire.HEADER_TENANT, str(FACTS[wire.META_TENANT]))])

    async def check(self, headers: Mapping[str, str], body: bytes, *, held: Held) -> Answer:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return Answer(200, self.metadata, [])


async def serve_all(settings: ServeSettings, args: argparse.Namespace) -> None:
    delay_s = args.check_delay_ms / 1000
    if args.http_port is not None:
        await HttpCheckServer(HttpCheck(args.pick, delay_s)).start("127.0.0.1", args.http_port)
    await serve("trivial", settings, register(args.pick, delay_s))


def register(pick: str, delay_s: float) -> Any:
    def add(server: grpc.aio.Server) -> None:
        external_auth_pb2_grpc.add_AuthorizationServicer_to_server(Auth(pick, delay_s), server)
        rls_pb2_grpc.add_RateLimitServiceServicer_to_server(RateLimit(), server)
        ep_grpc.add_ExternalProcessorServicer_to_server(Pick(pick), server)
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(Logs(), server)

    return add


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--pick", required=True, help="ip:port picked")
    parser.add_argument("--http-port", type=int, help="answer checks over HTTP on this port too")
    parser.add_argument("--check-delay-ms", type=float, default=0.0, help="idle wait per Check")
    args = parser.parse_args()
    run(lambda: serve_all(ServeSettings(port=args.port), args))


if __name__ == "__main__":
    main()
