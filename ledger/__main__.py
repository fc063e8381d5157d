"""Composition root: `python -m ledger [--config FILE]` or `--check-config FILE`."""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
from pathlib import Path

from pydantic import SecretStr

from ledger import gputime, metrics
from ledger.alerts import Alerts
from ledger.blame import Blame
from ledger.breaker import Breakers
from ledger.db import Ledger
from ledger.detectors import Detectors, Gap
from ledger.gputime import Batches
from ledger.reconcile import Database, Reconciler
from ledger.recorder import Recorder
from ledger.service import AccessLogService, register
from ledger.settings import ENV_PREFIX, AlertSettings, Settings
from ledger.spending import SpendAlerts
from ledger.webhooks import Hook, Webhooks
from llmgw import telemetry
from llmgw.config import load, reveal
from llmgw.link import RedisLink
from llmgw.serve import command, serve
from llmgw.tiers import load_tiers, watched_tiers

NAME = "ledger"


async def main(settings: Settings) -> None:
    tracer = telemetry.setup(NAME, settings.tracing)
    telemetry.TENANTS.limit = settings.metrics.tenant_labels
    metrics.MODELS.limit = settings.metrics.model_labels
    db = (
        Ledger(settings.database_url.get_secret_value(), backlog_max=settings.backlog_max)
        if settings.database_url is not None
        else None
    )
    # The database may come up after us: records wait in the writer's backlog meanwhile.
    connecting = asyncio.create_task(db.start(timeout_s=math.inf)) if db is not None else None
    webhooks = _webhooks(settings.alerts)
    alerts = Alerts(
        Detectors(settings.alerts.rules),
        db,
        webhooks,
        backlog=lambda: {"unsettled": recorder.pending, "unwritten": db.backlog if db else 0},
        gap=lambda: reconciler.gap() if reconciler is not None else Gap(),
        interval_s=settings.alerts.interval_s,
    )
    tiers = watched_tiers(settings.tiers_file)
    watcher = asyncio.create_task(tiers.watch(settings.reload_interval_s))
    breakers = Breakers(tiers.get, db, alerts.emit, Blame(settings.blame))
    redis = RedisLink.of(settings.redis)
    batches = Batches()
    following = asyncio.create_task(gputime.follow(redis, batches, settings.batches_interval_s))
    recorder = Recorder.of(
        redis,
        db,
        settings.settle,
        alerts,
        breakers,
        prices=lambda: tiers.get().prices,
        batches=batches,
        spending=SpendAlerts(tiers.get, alerts.emit),
    )
    recorder.start()
    reconciler = _reconciler(settings, recorder, db)
    webhooks.start()
    alerts.start()

    async def drain() -> None:
        for task in (watcher, following):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if reconciler is not None:
            await reconciler.close()
        await recorder.close(settings.drain_s)
        await alerts.close()
        await webhooks.close(settings.drain_s)
        if connecting is not None and not connecting.done():
            connecting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await connecting
        if db is not None:
            await db.close(settings.drain_s)

    await serve(NAME, settings.serve, register(AccessLogService(recorder.add, tracer)), drain)


def _reconciler(settings: Settings, recorder: Recorder, db: Ledger | None) -> Reconciler | None:
    """The reconciler of the access log the settings name, started; it needs the database."""
    r = settings.reconcile
    if r is None or settings.database_url is None or db is None:
        return None
    reconciler = Reconciler(
        r.access_log,
        recorder,
        Database(settings.database_url.get_secret_value()),
        checkpoint=r.checkpoint,
        lag_s=r.lag_s,
        interval_s=r.interval_s,
        holders=(recorder, db),
    )
    reconciler.start()
    return reconciler


def _webhooks(a: AlertSettings) -> Webhooks:
    def key(hook_secret: SecretStr | None) -> bytes:
        return (reveal(hook_secret) or reveal(a.secret) or "").encode()  # settings ensure one

    hooks = {k: [Hook(str(h.url), key(h.secret)) for h in hs] for k, hs in a.hooks.items()}
    return Webhooks(
        hooks,
        queue_max=a.queue_max,
        attempts=a.attempts,
        backoff_s=a.backoff_s,
        backoff_max_s=a.backoff_max_s,
        timeout_s=a.timeout_s,
    )


def settings(path: Path | None) -> Settings:
    """The settings and the tier table they name, both validated."""
    loaded = load(Settings, path, ENV_PREFIX)
    load_tiers(loaded.tiers_file)
    return loaded


def cli(argv: list[str] | None = None) -> int:
    return command(NAME, __doc__, settings, main, argv)


if __name__ == "__main__":
    sys.exit(cli())
