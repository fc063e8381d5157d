"""`python -m ledger.sidecar [--config FILE]`: the reconciler beside an Envoy of its own.

In compose and Kubernetes every Envoy writes its file access log in its own pod; this runs in
that pod (the log on a shared volume) with the ledger's settings (LLMGW_LEDGER__… overrides;
`reconcile.access_log` required) and settles and stores what the gRPC access log did not deliver,
through a recorder and database writer of its own, the same idempotent ones as the ledger's.
It serves gRPC health and its metrics (llmgw_ledger_reconciled_total, …) like a service.
"""

from __future__ import annotations

import asyncio
import math
import sys
from pathlib import Path

from ledger.db import Ledger
from ledger.reconcile import Database, Reconciler
from ledger.recorder import Recorder
from ledger.settings import ENV_PREFIX, Settings
from llmgw.config import ConfigError, load
from llmgw.link import RedisLink
from llmgw.serve import command, serve
from llmgw.tiers import watched_tiers

NAME = "ledger-reconcile"


async def main(settings: Settings) -> None:
    r, url = settings.reconcile, settings.database_url
    assert r is not None and url is not None  # checked when the settings load
    db = Ledger(url.get_secret_value(), backlog_max=settings.backlog_max)
    connecting = asyncio.create_task(db.start(timeout_s=math.inf))
    tiers = watched_tiers(settings.tiers_file)  # the price table: records found here are priced
    watcher = asyncio.create_task(tiers.watch(settings.reload_interval_s))
    recorder = Recorder.of(
        RedisLink.of(settings.redis), db, settings.settle, prices=lambda: tiers.get().prices
    )
    recorder.start()
    reconciler = Reconciler(
        r.access_log,
        recorder,
        Database(url.get_secret_value()),
        checkpoint=r.checkpoint,
        lag_s=r.lag_s,
        interval_s=r.interval_s,
        holders=(recorder, db),
    )
    reconciler.start()

    async def drain() -> None:
        watcher.cancel()
        await reconciler.close(settings.drain_s)  # its pod's file may go with it
        await recorder.close(settings.drain_s)
        if not connecting.done():
            connecting.cancel()
        await db.close(settings.drain_s)

    await serve(NAME, settings.serve, lambda server: None, drain)


def settings(path: Path | None) -> Settings:
    loaded = load(Settings, path, ENV_PREFIX)
    if loaded.reconcile is None:
        raise ConfigError("reconcile.access_log: required (the Envoy access log to reconcile)")
    return loaded


def cli(argv: list[str] | None = None) -> int:
    return command(NAME, __doc__, settings, main, argv)


if __name__ == "__main__":
    sys.exit(cli())
