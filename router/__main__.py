"""`python -m router [--config FILE] [--check-config FILE]`: the composition root."""

from __future__ import annotations

import sys
from pathlib import Path

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from llmgw import telemetry
from llmgw.serve import command, serve
from router.picker import HEALTH_SERVICES, InferencePoolService
from router.registry import default_registry
from router.runtime import Router
from router.service import RouterService
from router.settings import Settings, check

NAME = "router"


async def main(settings: Settings) -> None:
    router = Router.from_settings(settings, telemetry.setup(NAME, settings.tracing))
    await router.start()
    pool = settings.inference_pool
    service = InferencePoolService(router, pool) if pool.enabled else RouterService(router)

    def register(server: grpc.aio.Server) -> None:
        pb_grpc.add_ExternalProcessorServicer_to_server(service, server)
        router.register(server)

    health = HEALTH_SERVICES if pool.enabled else ()
    await serve(NAME, settings.serve, register, router.stop, health)


def settings(path: Path | None) -> Settings:
    """The settings with the plugin profile built, so a broken profile is refused here."""
    return check(path, default_registry())


def cli(argv: list[str] | None = None) -> int:
    return command(NAME, __doc__, settings, main, argv)


if __name__ == "__main__":
    sys.exit(cli())
