"""Composition root: `python -m extauthz [--config FILE]` or `--check-config FILE`."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from pathlib import Path

from extauthz import tenants
from extauthz.decision import Decider
from extauthz.service import AuthorizationService, BodyPool, register
from extauthz.sessions import SessionCodec, Sessions
from extauthz.settings import ENV_PREFIX, Settings
from extauthz.store import TenantsStore
from llmgw import telemetry
from llmgw.config import load
from llmgw.serve import command, serve

NAME = "extauthz"


def build_sessions(settings: Settings) -> Sessions:
    s = settings.sessions
    codec = SessionCodec(
        secret=s.secret.get_secret_value().encode(),
        previous=s.previous_secret.get_secret_value().encode() if s.previous_secret else None,
        max_age_ms=int(s.max_age_seconds * 1000),
    )
    return Sessions(codec, s.worker_id)


def cache_secret(settings: Settings) -> bytes:
    """The key of the tenants' cache salts: the session secret (salts are HMACs with their own
    label, so neither reveals the other); rotating it costs each group one cold cache."""
    return settings.sessions.secret.get_secret_value().encode()


async def main(settings: Settings) -> None:
    tracer = telemetry.setup(NAME, settings.tracing)
    store = TenantsStore(settings.tenants_file)
    decider = Decider(settings.decision, build_sessions(settings), cache_secret(settings))
    bodies = BodyPool(decider, settings.decision.pool_body_bytes)
    await bodies.start()
    service = AuthorizationService(store, decider, tracer, bodies=bodies)
    watcher = asyncio.create_task(store.watch(settings.reload_interval_seconds))

    async def stop() -> None:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        bodies.close()

    await serve(NAME, settings.serve, register(service), stop)


def settings(path: Path | None) -> Settings:
    """The settings and the tenants file they name, both validated."""
    loaded = load(Settings, path, ENV_PREFIX)
    tenants.read(loaded.tenants_file)
    return loaded


def cli(argv: list[str] | None = None) -> int:
    return command(NAME, __doc__, settings, main, argv)


if __name__ == "__main__":
    sys.exit(cli())
