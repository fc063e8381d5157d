"""Composition root: `python -m extauthz [--config FILE]` or `--check-config FILE`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from pathlib import Path

from extauthz import tenants
from extauthz.decision import Decider
from extauthz.service import AuthorizationService, register
from extauthz.sessions import SessionCodec, Sessions
from extauthz.settings import ENV_PREFIX, Settings
from extauthz.store import TenantsStore
from llmgw import logs, telemetry
from llmgw.config import ConfigError, load
from llmgw.serve import run, serve

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
    service = AuthorizationService(
        store, Decider(settings.decision, build_sessions(settings), cache_secret(settings)), tracer
    )
    watcher = asyncio.create_task(store.watch(settings.reload_interval_seconds))

    async def stop_watching() -> None:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher

    await serve(NAME, settings.serve, register(service), stop_watching)


def check_config(path: Path) -> int:
    """Validate the settings and the tenants file they name; print the first problem."""
    try:
        settings = load(Settings, path, ENV_PREFIX)
        tenants.read(settings.tenants_file)
    except ConfigError as exc:
        print(f"invalid: {exc}", file=sys.stderr)
        return 1
    print(f"ok: {path} (tenants: {settings.tenants_file})")
    return 0


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m extauthz", description=__doc__)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--config", type=Path, help="settings YAML file")
    group.add_argument("--check-config", type=Path, metavar="FILE", help="validate and exit")
    args = parser.parse_args(argv)
    if args.check_config is not None:
        return check_config(args.check_config)
    try:
        settings = load(Settings, args.config, ENV_PREFIX)
        logs.setup(settings.log_level)
        run(lambda: main(settings))
    except ConfigError as exc:
        print(f"extauthz: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli())
