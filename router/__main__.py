"""`python -m router [--config FILE] [--check-config FILE]`: the composition root."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import grpc
from envoy.service.accesslog.v3 import als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from llmgw import telemetry
from llmgw.link import RedisLink
from llmgw.serve import command, serve
from router.engine import Engine
from router.fleet import Fleet
from router.picker import HEALTH_SERVICES, InferencePoolService
from router.registry import default_registry
from router.service import OutcomeService, RouterService
from router.settings import Settings, check, redis_address

NAME = "router"


async def main(settings: Settings) -> None:
    tracer = telemetry.setup(NAME, settings.tracing)
    registry = default_registry()
    engine = Engine(registry.build(settings.plugins, settings.profile))
    fleet = Fleet(settings.fleet)
    fleet.set_pods(await fleet.resolve())
    pool = settings.inference_pool
    service = (
        InferencePoolService(fleet, engine, tracer, pool)
        if pool.enabled
        else RouterService(fleet, engine, tracer)
    )
    redis = None
    if settings.redis_url is not None:
        host, port, password = redis_address(settings.redis_url)
        redis = RedisLink(
            host, port, settings.fleet.publish_interval, password, cluster=settings.redis_cluster
        )
    tasks = [
        asyncio.create_task(fleet.run_resolver()),
        asyncio.create_task(fleet.run_scrapes()),
    ]
    if redis is not None:
        tasks.append(asyncio.create_task(fleet.run_publisher(redis)))

    def register(server: grpc.aio.Server) -> None:
        pb_grpc.add_ExternalProcessorServicer_to_server(service, server)
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(OutcomeService(fleet), server)

    async def on_stop() -> None:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if redis is not None:
            await redis.close()

    health = HEALTH_SERVICES if pool.enabled else ()
    await serve("router", settings.serve, register, on_stop, health)


def settings(path: Path | None) -> Settings:
    """The settings with the plugin profile built, so a broken profile is refused here."""
    return check(path, default_registry())


def cli(argv: list[str] | None = None) -> int:
    return command(NAME, __doc__, settings, main, argv)


if __name__ == "__main__":
    sys.exit(cli())
