"""Composition root: `python -m ratelimit [--config FILE] [--check-config FILE]`."""

from __future__ import annotations

import sys

import grpc
from envoy.service.ratelimit.v3 import rls_pb2_grpc

from llmgw import telemetry
from llmgw.serve import command, serve
from ratelimit.runtime import RateLimiter
from ratelimit.service import RateLimitService
from ratelimit.settings import Settings, check

NAME = "ratelimit"


async def main(settings: Settings) -> None:
    telemetry.TENANTS.limit = settings.metrics.tenant_labels
    limiter = RateLimiter(settings)
    await limiter.start()
    servicer = RateLimitService(limiter.limiter, telemetry.setup(NAME, settings.tracing))

    def register(server: grpc.aio.Server) -> None:
        rls_pb2_grpc.add_RateLimitServiceServicer_to_server(servicer, server)

    await serve(
        "envoy.service.ratelimit.v3.RateLimitService", settings.serve, register, limiter.stop
    )


def cli(argv: list[str] | None = None) -> int:
    return command(NAME, __doc__, check, main, argv)


if __name__ == "__main__":
    sys.exit(cli())
