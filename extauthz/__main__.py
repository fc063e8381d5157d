"""Composition root: `python -m extauthz [--config FILE]` or `--check-config FILE`."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import grpc

from extauthz import tenants
from extauthz.bodypool import BodyPool
from extauthz.decision import Decider
from extauthz.director import Director
from extauthz.fairness import Sharing
from extauthz.flow import FlowControl
from extauthz.follower import TenantsFollower
from extauthz.httpserver import HttpCheckServer
from extauthz.responseids import ResponseIds
from extauthz.service import register
from extauthz.sessions import SessionCodec, Sessions
from extauthz.settings import ENV_PREFIX, Settings
from extauthz.store import TenantsSource, tenants_store
from llmgw import telemetry
from llmgw.config import ConfigError, load
from llmgw.serve import command, serve
from llmgw.tiers import load_tiers
from llmgw.tls import server_context
from ratelimit import settings as ratelimit_settings
from ratelimit.runtime import RateLimiter
from router import settings as router_settings
from router.registry import default_registry
from router.runtime import Router

NAME = "extauthz"


def build_sessions(settings: Settings) -> Sessions:
    s = settings.sessions
    codec = SessionCodec(
        secret=s.secret.get_secret_value().encode(),
        previous=s.previous_secret.get_secret_value().encode() if s.previous_secret else None,
        max_age_ms=int(s.max_age_seconds * 1000),
    )
    return Sessions(codec, s.worker_id)


def response_ids(settings: Settings) -> ResponseIds:
    """The stored responses' IDs, keyed by the session secret (their own derived keys): the
    previous secret's IDs still read during a rotation."""
    s = settings.sessions
    previous = s.previous_secret.get_secret_value().encode() if s.previous_secret else None
    return ResponseIds(s.secret.get_secret_value().encode(), previous)


def cache_secret(settings: Settings) -> bytes:
    """The key of the tenants' cache salts: the session secret (salts are HMACs with their own
    label, so neither reveals the other); rotating it costs each group one cold cache."""
    return settings.sessions.secret.get_secret_value().encode()


async def main(settings: Settings) -> None:
    tracer = telemetry.setup(NAME, settings.tracing)
    telemetry.TENANTS.limit = settings.metrics.tenant_labels
    store, follow = await tenants_source(settings)
    limiter = None
    if settings.holds_limiter:
        limiter = held_limiter(admitting(settings), store)
        await limiter.start()
    router = None
    if settings.holds_router:
        router = Router.from_settings(picking(settings), tracer)
        await router.start()
    # The fleet's contexts bound the output cap: the router's own where it is held, else those
    # the router apart publishes, as the limiter reads them (every topology holds one of the two).
    contexts = router.fleet.contexts if router is not None else limiter.fleet if limiter else None
    decider = Decider(
        settings.decision,
        build_sessions(settings),
        cache_secret(settings),
        contexts,
        response_ids(settings),
    )
    bodies = BodyPool(decider, settings.decision.pool_from_bytes)
    await bodies.start()
    flow = None
    tasks = [asyncio.create_task(follow)]
    if router is not None and settings.flow.enabled:
        flow = FlowControl(settings.flow, router)
        if limiter is not None:  # its Redis: the replicas' service counts merged there
            redis = limiter.store
            sharing = Sharing(
                flow.served,
                lambda: None if redis.redis is None else redis.redis.client,
                settings.flow.share_interval_s,
            )
            tasks.append(asyncio.create_task(sharing.run()))
    director = Director(
        store,
        decider,
        tracer,
        bodies=bodies,
        router=router,
        limiter=limiter,
        admit_timeout_s=settings.admit_timeout_ms / 1000,
        flow=flow,
    )
    checks = None
    if settings.http_port is not None:
        # A body larger than a tenant's share can never be held: refused at its head.
        checks = HttpCheckServer(
            director,
            max_body=settings.decision.tenant_body_bytes_in_flight,
            drain_s=settings.http_drain_seconds,
        )
        # The check port takes the gRPC port's certificates: a client without one of the CA's
        # fails the handshake (and only Envoy's client certificate is the CA's).
        tls = server_context(settings.serve.tls) if settings.serve.tls else None
        await checks.start(settings.serve.host, settings.http_port, tls)

    def add(server: grpc.aio.Server) -> None:
        register(director)(server)
        if router is not None:  # the router's access log: how its picks ended
            router.register(server)

    async def stop() -> None:
        if checks is not None:
            await checks.stop(settings.serve.grace_seconds)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if router is not None:
            await router.stop()
        if limiter is not None:
            await limiter.stop()
        await bodies.close()

    await serve(
        NAME,
        settings.serve,
        add,
        stop,
        on_drain=checks.drain if checks else None,
        healthy=lambda: director.healthy,  # its body pool broken beyond replacement: not serving
    )


async def tenants_source(settings: Settings) -> tuple[TenantsSource, Coroutine[Any, Any, None]]:
    """The snapshot's source, chosen at start, and the task that keeps it current."""
    if settings.tenants_source == "database":
        assert settings.tenants_database_url is not None and settings.tenants_cache is not None
        follower = await TenantsFollower.open(
            settings.tenants_database_url.get_secret_value(),
            settings.tenants_cache,
            settings.tiers_file,
            poll_seconds=settings.tenants_poll_seconds,
        )
        return follower, follower.run()
    store = tenants_store(settings.tenants_file, settings.tiers_file)
    return store, store.watch(settings.reload_interval_seconds)


def picking(settings: Settings) -> router_settings.Settings:
    """The settings of the router this process holds (only its fleet, plugins, profile and Redis
    apply: it serves on extauthz's port and traces with extauthz's tracer)."""
    held = router_settings.check(settings.router_config, default_registry())
    if held.inference_pool.enabled:
        raise ConfigError("inference_pool: only `python -m router` speaks the picker protocol")
    return held


def held_limiter(settings: ratelimit_settings.Settings, store: TenantsSource) -> RateLimiter:
    """The rate limiter this process holds. It decides by the tier table of the tenants snapshot,
    the process's one load and swap of it: a tenant moved onto a new tier is never decided by a
    table without that tier (which would limit it as the default tier)."""
    return RateLimiter(settings, tiers=lambda: store.current.tiers)


def admitting(settings: Settings) -> ratelimit_settings.Settings:
    """The settings of the rate limiter this process holds (its serve, tracing, metrics and
    reload interval do not apply: it decides inside extauthz's Check, by the tier table of the
    tenants snapshot). Its tier table is extauthz's: a tier is defined once, and a limiter on
    another table would put a tenant's custom tier on the default one."""
    held = ratelimit_settings.check(settings.ratelimit_config)
    if held.tiers_file is None:
        return held.model_copy(update={"tiers_file": settings.tiers_file})
    if settings.tiers_file is None or held.tiers_file.resolve() != settings.tiers_file.resolve():
        raise ConfigError(
            f"the rate limiter's tiers_file ({held.tiers_file}) is not extauthz's tiers_file "
            f"({settings.tiers_file}): one tier table for both (leave the limiter's unset)"
        )
    return held


def settings(path: Path | None) -> Settings:
    """The settings and the files they name (tenants, tier table, the router's and the rate
    limiter's), all validated."""
    loaded = load(Settings, path, ENV_PREFIX)
    tiers = load_tiers(loaded.tiers_file)
    if loaded.tenants_source == "file":
        tenants.load(loaded.tenants_file, tiers)
    if loaded.holds_router:
        picking(loaded)
    if loaded.holds_limiter:
        admitting(loaded)
    return loaded


def cli(argv: list[str] | None = None) -> int:
    return command(NAME, __doc__, settings, main, argv)


if __name__ == "__main__":
    sys.exit(cli())
