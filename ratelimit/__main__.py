"""Composition root: `python -m ratelimit [--config FILE] [--check-config FILE]`."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import grpc
from envoy.service.ratelimit.v3 import rls_pb2_grpc

from llmgw import logs, telemetry, wire
from llmgw.config import ConfigError, load
from llmgw.serve import run, serve
from ratelimit.failover import Failover
from ratelimit.fleet import FleetView
from ratelimit.limiter import Limiter
from ratelimit.limits import Limits, load_limits
from ratelimit.service import RateLimitService
from ratelimit.settings import Settings
from ratelimit.store import LocalStore

ENV_PREFIX = "LLMGW_RATELIMIT"


def check_config(path: Path) -> int:
    try:
        settings = load(Settings, path, ENV_PREFIX)
        load_limits(settings.limits_file)
    except ConfigError as exc:
        print(f"invalid: {exc}", file=sys.stderr)
        return 1
    print(f"ok: {path}")
    return 0


async def main(settings: Settings) -> None:
    limits = Limits(load_limits(settings.limits_file))
    store = Failover(
        settings.redis.host,
        settings.redis.port,
        LocalStore(share=1 / settings.replicas),
        deadline_s=settings.redis.deadline_ms / 1000,
        probe_interval_s=settings.redis.probe_interval_s,
        connect_timeout_s=settings.redis.connect_timeout_s,
    )
    await store.start()
    fleet = FleetView(
        lambda: store.get_fleet(wire.FLEET_LOAD_KEY), time.time, settings.fleet.cache_s
    )
    limiter = Limiter(
        limits.policy,
        store,
        fleet.snapshot,
        time.time,
        reservation_ttl_s=settings.reservation_ttl_s,
        stale_after_s=settings.fleet.stale_after_s,
        near_limit_ratio=settings.near_limit_ratio,
    )
    tracer = telemetry.setup("ratelimit", settings.tracing)
    servicer = RateLimitService(limiter, tracer)

    def register(server: grpc.aio.Server) -> None:
        rls_pb2_grpc.add_RateLimitServiceServicer_to_server(servicer, server)

    await serve(
        "envoy.service.ratelimit.v3.RateLimitService", settings.serve, register, store.close
    )


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ratelimit")
    parser.add_argument(
        "--config", type=Path, help="settings YAML (env overrides: LLMGW_RATELIMIT__…)"
    )
    parser.add_argument("--check-config", type=Path, metavar="FILE", help="validate FILE, exit 0/1")
    args = parser.parse_args(argv)
    if args.check_config is not None:
        return check_config(args.check_config)
    try:
        settings = load(Settings, args.config, ENV_PREFIX)
        load_limits(settings.limits_file)
    except ConfigError as exc:
        print(f"invalid: {exc}", file=sys.stderr)
        return 1
    logs.setup(settings.log_level)
    run(lambda: main(settings))
    return 0


if __name__ == "__main__":
    sys.exit(cli())
