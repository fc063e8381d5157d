"""Fixtures of the admin API's tests: a real PostgreSQL (a fresh database per test: the shared
fixtures of tests/conftest.py) and the API served on a loopback port, reached over real HTTP;
`redis_api`, the same with a real redis-server holding the tenants' breakers."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aiohttp
import asyncpg
import pytest
from aiohttp import web

from admin.__main__ import connect
from admin.api import Admin
from admin.breakers import BreakerStates
from admin.reports import Reports
from admin.settings import Settings
from admin.store import Store
from llmgw.breaker import BreakerSpec
from llmgw.redisconf import RedisSettings
from llmgw.tiers import PerUnit, TierSpec, TierTable

OVERLAP_S = 3600.0  # the service's default rotation overlap in these tests
# A tier whose breaker trips at two 500s and runs its course in seconds: open 1.5 s, then
# half-open 10 %, 30 %, 100 % for 1 s each, then closed; one that stays open for 10 minutes
# (a read while open, however busy the machine); and a tier with no breaker.
FAST = BreakerSpec(threshold=2.0, cooldown_s=1.5, cooldown_max_s=3.0, step_s=1.0)
SLOW = BreakerSpec(threshold=2.0, cooldown_s=600.0, cooldown_max_s=1200.0, step_s=1.0)
TIERS = TierTable(
    tiers={
        "fast": TierSpec(requests=PerUnit(second=10**6), breaker=FAST),
        "slow": TierSpec(requests=PerUnit(second=10**6), breaker=SLOW),
        "plain": TierSpec(requests=PerUnit(second=10**6)),
    }
)


@dataclass
class Reply:
    status: int
    body: Any
    headers: dict[str, str]


@dataclass
class Api:
    """The running admin API: `call()` sends the admin token unless told `token=`."""

    url: str
    token: str
    database_url: str
    session: aiohttp.ClientSession

    async def call(
        self, method: str, path: str, body: Any = None, token: str | None = None, **query: Any
    ) -> Reply:
        headers = {"Authorization": f"Bearer {self.token if token is None else token}"}
        if token == "":
            headers = {}
        params = {k: str(v) for k, v in query.items() if v is not None}
        async with self.session.request(
            method, self.url + path, json=body, headers=headers, params=params
        ) as r:
            text = await r.text()
            parsed = await r.json(content_type=None) if text.startswith(("{", "[")) else text
            return Reply(r.status, parsed, dict(r.headers))

    async def ok(self, method: str, path: str, body: Any = None, **query: Any) -> Any:
        reply = await self.call(method, path, body, **query)
        assert reply.status == 200, reply.body
        return reply.body

    async def tenant(self, tenant_id: str, tier: str = "standard", **spec: Any) -> Any:
        body = {"id": tenant_id, "name": tenant_id, "tier": tier, "priority": 5, "models": "*"}
        return await self.ok("POST", "/admin/v1/tenants", {**body, **spec})

    async def rows(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        conn = await asyncpg.connect(self.database_url)
        try:
            return list(await conn.fetch(sql, *args))
        finally:
            await conn.close()


@pytest.fixture
async def api(db: str) -> AsyncIterator[Api]:
    """The admin API with no Redis: breaker state not served."""
    async with serve(db) as running:
        yield running


@pytest.fixture
async def redis_api(db: str, redis: int) -> AsyncIterator[Api]:
    """The admin API reading the breakers in `redis`, its tier table `TIERS`."""
    async with serve(db, RedisSettings(port=redis), TIERS) as running:
        yield running


@contextlib.asynccontextmanager
async def serve(
    db: str,
    redis: RedisSettings | None = None,
    tiers: TierTable | None = None,
    clock: Callable[[], datetime] = lambda: datetime.now(UTC),
) -> AsyncIterator[Api]:
    token = secrets.token_hex(32)
    settings = Settings.model_validate({"database_url": db, "admin_token": token})
    pool = await connect(settings)
    table = tiers or TierTable()
    states = BreakerStates(redis)
    admin = Admin(Store(pool, lambda: table), Reports(pool), token, OVERLAP_S, states, clock)
    runner = web.AppRunner(admin.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with aiohttp.ClientSession() as session:
            yield Api(f"http://127.0.0.1:{port}", token, db, session)
    finally:
        await runner.cleanup()
        await states.close()
        await pool.close()
