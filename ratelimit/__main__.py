"""Composition root: `python -m ratelimit [--config FILE] [--check-config FILE]`."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from pathlib import Path

import grpc
from envoy.service.ratelimit.v3 import rls_pb2_grpc

from llmgw import telemetry, wire
from llmgw.config import load, reveal
from llmgw.reload import Reloading
from llmgw.serve import command, serve
from llmgw.tiers import load_tiers
from ratelimit.failover import Failover
from ratelimit.fleet import FleetView
from ratelimit.limiter import Limiter
from ratelimit.limits import reload_limits
from ratelimit.pool import Pool
from ratelimit.service import RateLimitService
from ratelimit.settings import Settings

ENV_PREFIX = "LLMGW_RATELIMIT"


NAME = "ratelimit"


def settings(path: Path | None) -> Settings:
    """The settings and the tier table they name, both validated."""
    loaded = load(Settings, path, ENV_PREFIX)
    load_tiers(loaded.limits_file)
    return loaded


async def main(settings: Settings) -> None:
    path = settings.limits_file
    limits = Reloading("tiers", [path] if path else [], lambda last: reload_limits(path, last))
    store = Failover(
        settings.redis.host,
        settings.redis.port,
        replicas=settings.replicas,
        deadline_s=settings.redis.deadline_ms / 1000,
        probe_interval_s=settings.redis.probe_interval_s,
        connect_timeout_s=settings.redis.connect_timeout_s,
        password=reveal(settings.redis.password),
        cluster=settings.redis.cluster,
    )
    await store.start()
    fleet = FleetView(
        lambda: store.get_fleet(wire.FLEET_LOAD_KEY), time.time, settings.fleet.cache_s
    )
    limiter = Limiter(
        lambda tenant, tier: limits.current.policy(tenant, tier),
        store,
        fleet.snapshot,
        time.time,
        reservation_ttl_s=settings.reservation_ttl_s,
        stale_after_s=settings.fleet.stale_after_s,
        near_limit_ratio=settings.near_limit_ratio,
        pool=Pool(
            lambda: None if store.redis is None else store.redis.client,
            deadline_s=settings.redis.deadline_ms / 1000,
        ),
    )
    tracer = telemetry.setup(NAME, settings.tracing)
    servicer = RateLimitService(limiter, tracer)

    def register(server: grpc.aio.Server) -> None:
        rls_pb2_grpc.add_RateLimitServiceServicer_to_server(servicer, server)

    watcher = asyncio.create_task(limits.watch(settings.reload_interval_s))

    async def stop() -> None:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        await store.close()

    await serve("envoy.service.ratelimit.v3.RateLimitService", settings.serve, register, stop)


def cli(argv: list[str] | None = None) -> int:
    return command(NAME, __doc__, settings, main, argv)


if __name__ == "__main__":
    sys.exit(cli())
