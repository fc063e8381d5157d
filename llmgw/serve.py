"""One way to run a gRPC service: grpc.aio on uvloop, health, metrics, clean SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import grpc
import uvloop
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from prometheus_client import start_http_server
from pydantic import Field

from llmgw import logs
from llmgw.config import ConfigError, Strict
from llmgw.tls import OnlyPeer, TlsSettings, server_credentials

log = logging.getLogger(__name__)


class ServeSettings(Strict):
    host: str = "127.0.0.1"
    port: int = 0
    metrics_host: str = "127.0.0.1"  # admin endpoints bind to localhost by default
    metrics_port: int | None = None  # None: no metrics endpoint
    grace_seconds: float = 5.0
    # Above Envoy's request-body limit (8 MiB) plus its framing: ext_authz receives whole bodies,
    # and gRPC's default of 4 MiB turned 4-8 MiB requests into "authorization unavailable".
    max_message_bytes: int = Field(default=16 * 1024 * 1024, gt=0)
    # Mutual TLS on `port` (llmgw/tls.py): only Envoy's certificate gets a call answered. None:
    # plaintext, anyone who reaches the port is served (tests of one service; never deployed).
    tls: TlsSettings | None = None
    # gRPC health alone, plaintext, on this port of `host`: for probes that speak no TLS
    # (Kubernetes', the image's HEALTHCHECK). None: health only on `port`.
    health_port: int | None = Field(default=None, ge=0, le=65535)


async def serve(
    name: str,
    settings: ServeSettings,
    register: Callable[[grpc.aio.Server], None],
    on_stop: Callable[[], Awaitable[None]] | None = None,
    health_services: Sequence[str] = (),
    on_drain: Callable[[], None] | None = None,
    healthy: Callable[[], bool] | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT, then drain in-flight RPCs for `grace_seconds` (and call
    `on_drain` first: what else the service serves starts draining at the same time), then
    `on_stop`.

    gRPC health answers SERVING for "", `name` and each of `health_services`; NOT_SERVING
    while `healthy()` is false, if given (checked every second)."""
    tls = settings.tls
    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", settings.max_message_bytes),
            ("grpc.max_send_message_length", settings.max_message_bytes),
        ],
        interceptors=[OnlyPeer(tls.peer)] if tls is not None else None,
    )
    register(server)
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{settings.host}:{settings.port}"
    if tls is None:
        log.warning(
            "serving without TLS: anyone who reaches the port is served", extra={"service": name}
        )
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, server_credentials(tls))
    if port == 0:
        raise OSError(f"{name}: cannot bind {address}")
    health = None
    if settings.health_port is not None:
        health = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health)
        if health.add_insecure_port(f"{settings.host}:{settings.health_port}") == 0:
            raise OSError(f"{name}: cannot bind health port {settings.health_port}")
    if settings.metrics_port is not None:
        start_http_server(settings.metrics_port, settings.metrics_host)
    await server.start()
    if health is not None:
        await health.start()
    names = ("", name, *health_services)
    for service in names:
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    follower = None
    if healthy is not None:
        follower = asyncio.create_task(follow_health(health_servicer, names, healthy))
    log.info("serving", extra={"service": name, "port": port, "metrics": settings.metrics_port})

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping", extra={"service": name})
    if on_drain is not None:
        on_drain()
    if follower is not None:
        follower.cancel()
    await health_servicer.enter_graceful_shutdown()
    await server.stop(settings.grace_seconds)
    if health is not None:  # NOT_SERVING until the port closes: draining, not dead
        await health.stop(None)
    if on_stop is not None:
        await on_stop()


async def follow_health(
    servicer: HealthServicer,
    names: Sequence[str],
    healthy: Callable[[], bool],
    every_s: float = 1.0,
) -> None:
    """Keep gRPC health at what `healthy()` says, looked at every `every_s`."""
    serving = True
    while True:
        await asyncio.sleep(every_s)
        if healthy() == serving:
            continue
        serving = not serving
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        log.warning("health changed", extra={"serving": serving})
        for service in names:
            await servicer.set(service, status)


class HasLogLevel(Protocol):
    log_level: str


S = TypeVar("S", bound=HasLogLevel)


def command(
    name: str,
    doc: str | None,
    settings: Callable[[Path | None], S],
    main: Callable[[S], Coroutine[Any, Any, None]],
    argv: list[str] | None = None,
) -> int:
    """Every service's `python -m NAME [--config FILE | --check-config FILE]`, one shape:
    `settings(path)` loads the file, its environment overrides and every file it names (tenants,
    limits, plugins), raising ConfigError; `--check-config` stops there (exit 0 or 1)."""
    parser = argparse.ArgumentParser(prog=f"python -m {name}", description=doc)
    group = parser.add_mutually_exclusive_group()
    env = f"LLMGW_{name.upper()}__…"
    group.add_argument("--config", type=Path, help=f"settings YAML (env overrides: {env})")
    group.add_argument("--check-config", type=Path, metavar="FILE", help="validate and exit")
    args = parser.parse_args(argv)
    try:
        loaded = settings(args.check_config or args.config)
    except ConfigError as exc:
        print(f"{name}: invalid: {exc}", file=sys.stderr)
        return 1
    if args.check_config is not None:
        print(f"{name}: ok: {args.check_config}")
        return 0
    logs.setup(loaded.log_level)
    run(lambda: main(loaded))
    return 0


async def finish(task: asyncio.Task[None] | None, within_s: float) -> None:
    """Let a background loop finish its work for up to `within_s`, then cancel it."""
    if task is None:
        return
    try:
        await asyncio.wait_for(asyncio.shield(task), within_s)
    except TimeoutError:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def run(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run a service's async main on uvloop (about 20 % cheaper per gRPC call)."""
    uvloop.run(main())
