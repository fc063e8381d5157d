"""Composition root: `python -m ledger [--config FILE]` or `--check-config FILE`."""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
from pathlib import Path

from ledger.db import Ledger
from ledger.recorder import Recorder
from ledger.service import AccessLogService, register
from ledger.settings import ENV_PREFIX, Settings
from llmgw import telemetry
from llmgw.config import load, reveal
from llmgw.link import RedisLink
from llmgw.serve import command, serve

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
        RedisLink(
            settings.redis.host,
            settings.redis.port,
            settings.redis.connect_timeout_s,
            reveal(settings.redis.password),
            cluster=settings.redis.cluster,
        ),
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


def settings(path: Path | None) -> Settings:
    return load(Settings, path, ENV_PREFIX)


def cli(argv: list[str] | None = None) -> int:
    return command(NAME, __doc__, settings, main, argv)


if __name__ == "__main__":
    sys.exit(cli())
