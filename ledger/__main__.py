"""Composition root: `python -m ledger [--config FILE]` or `--check-config FILE`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import sys
from pathlib import Path

from ledger.db import Ledger
from ledger.recorder import Recorder, RedisLink
from ledger.service import AccessLogService, register
from ledger.settings import ENV_PREFIX, Settings
from llmgw import logs, telemetry
from llmgw.config import ConfigError, load
from llmgw.serve import run, serve

NAME = "ledger"


async def main(settings: Settings) -> None:
    tracer = telemetry.setup(NAME, settings.tracing)
    db = (
        Ledger(settings.database_url.get_secret_value(), backlog_max=settings.backlog_max)
        if settings.database_url is not None
        else None
    )
    # The database may come up after us: records wait in the writer's backlog meanwhile.
    connecting = asyncio.create_task(db.start(timeout_s=math.inf)) if db is not None else None
    s = settings.settle
    recorder = Recorder(
        RedisLink(settings.redis.host, settings.redis.port, settings.redis.connect_timeout_s),
        db,
        batch_max=s.batch_max,
        pending_max=s.pending_max,
        done_ttl_s=s.done_ttl_s,
        timeout_s=settings.redis.timeout_s,
        retry_max_s=s.retry_max_s,
    )
    recorder.start()

    async def drain() -> None:
        await recorder.close(settings.drain_s)
        if connecting is not None and not connecting.done():
            connecting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await connecting
        if db is not None:
            await db.close(settings.drain_s)

    await serve(NAME, settings.serve, register(AccessLogService(recorder.add, tracer)), drain)


def check_config(path: Path) -> int:
    try:
        load(Settings, path, ENV_PREFIX)
    except ConfigError as exc:
        print(f"invalid: {exc}", file=sys.stderr)
        return 1
    print(f"ok: {path}")
    return 0


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ledger", description=__doc__)
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
        print(f"ledger: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli())
