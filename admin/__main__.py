"""Composition root: `python -m admin [--config FILE]` or `--check-config FILE`.

The admin API (HTTP+JSON, admin/routes.py) on `host:port`: tenants and their keys in PostgreSQL,
and what the ledger recorded there. Connects (waiting up to `connect_timeout_s` for the
database), applies its migrations and the ledger's (it reads the ledger's tables: whichever
service starts first creates them, under one lock), imports `import_tenants_file` if set, then
serves until SIGTERM or SIGINT, letting requests in flight finish. Redis (`redis`, where the
breakers' state is read) is connected on first use: the API starts while it is down."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from pathlib import Path

import asyncpg
from aiohttp import web

from admin.api import Admin
from admin.breakers import BreakerStates
from admin.reports import Reports
from admin.settings import ENV_PREFIX, Settings
from admin.store import Store, init_connection, is_database_error
from extauthz import tenants
from ledger.db import migrate, migrations
from llmgw.config import load
from llmgw.serve import command
from llmgw.tiers import load_tiers, watched_tiers

NAME = "admin"
MIGRATIONS_TABLE = "admin_schema_migrations"
log = logging.getLogger(NAME)


async def main(settings: Settings) -> None:
    tiers = watched_tiers(settings.tiers_file)
    watcher = asyncio.create_task(tiers.watch(settings.reload_interval_s))
    pool = await connect(settings)
    breakers = BreakerStates(settings.redis, settings.redis_timeout_s)  # connected on first use
    try:
        store = Store(pool, tiers.get)
        if settings.import_tenants_file is not None:
            data = tenants.read(settings.import_tenants_file)
            imported = await store.import_tenants(data.tenants)
            log.info("tenants imported", extra={"changed": imported})
        admin = Admin(
            store,
            Reports(pool, concurrent=max(1, settings.pool_size - 1)),
            settings.admin_token.get_secret_value(),
            settings.rotation_overlap_s,
            breakers,
        )
        await serve(admin.app(), settings)
    finally:
        await breakers.close()
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        await pool.close()


async def connect(settings: Settings) -> asyncpg.Pool:
    """The pool, once the database answers and both schemas are current."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + settings.connect_timeout_s
    while True:
        try:
            pool = await asyncpg.create_pool(
                settings.database_url.get_secret_value(),
                min_size=1,
                max_size=settings.pool_size,
                command_timeout=settings.command_timeout_s,
                init=init_connection,
                server_settings={"application_name": "llmgw-admin"},
            )
            async with pool.acquire() as conn:
                await migrate(conn)
                await migrate(conn, migrations(NAME), MIGRATIONS_TABLE)
            return pool
        except Exception as exc:
            if not is_database_error(exc) or loop.time() > deadline:
                raise
            log.warning("database not usable yet", extra={"error": repr(exc)})
            await asyncio.sleep(0.5)


async def serve(app: web.Application, settings: Settings) -> None:
    runner = web.AppRunner(app, shutdown_timeout=settings.grace_seconds, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port)
    await site.start()
    log.info("serving", extra={"service": NAME, "host": settings.host, "port": settings.port})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping", extra={"service": NAME})
    await runner.cleanup()


def settings(path: Path | None) -> Settings:
    """The settings, the tier table they name and the tenants file to import, all validated."""
    loaded = load(Settings, path, ENV_PREFIX)
    table = load_tiers(loaded.tiers_file)
    if loaded.import_tenants_file is not None:  # extauthz's rules: a tier of the table
        tenants.load(loaded.import_tenants_file, table)
    return loaded


def cli(argv: list[str] | None = None) -> int:
    return command(NAME, __doc__, settings, main, argv)


if __name__ == "__main__":
    sys.exit(cli())
