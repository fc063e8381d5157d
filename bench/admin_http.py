"""The admin API and its console over HTTP at scale: each route's answer time, p50/p90/max.
`python -m bench.admin_http [TENANTS] [KEYS_PER_TENANT] [OUTCOMES] [CALLS]` (100,000 × 10,
1,000,000 outcomes, 20 calls a route by default; e.g. `1000 2 10000 5` for a quick try).

A PostgreSQL of its own (tools.postgres) is filled server-side (generate_series): the tenants
and keys of bench/tenants_db.py, and the ledger's `outcomes` spread over the last 30 days, in
sessions of 5 requests; a tenth of the sessions belong to 10 heavy tenants (t1…t10), and t1 also
has one session of OUTCOMES / 10 requests over the last 2 days. The admin app (admin/api.py,
the console under /console/) is served on a free loopback port in this process, on the pool
`python -m admin` makes, and each route is called CALLS times after one call to warm it, one
request at a time, timed at the client."""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import asyncpg
from aiohttp import web

from admin.__main__ import connect
from admin.api import Admin
from admin.reports import Reports
from admin.settings import Settings
from admin.store import Store
from bench.tenants_db import FILL, FILL_KEYS
from llmgw.tiers import TierTable
from tools.postgres import Postgres

TOKEN = "9f2c41e8a7b3d6055f1e2a9c0b7d64e3"
SPAN_S = 30 * 86_400 - 3_600  # the outcomes' span: within the last 30 days
HEAVY = 10  # t1…t10 have a tenth of the sessions
# Row i: session i / 5; a session's tenant is a heavy one for every tenth session, else spread
# over all tenants ($1: the tenants, $2: the rows).
FILL_OUTCOMES = f"""
INSERT INTO outcomes (request_id, ts, tenant, tier, session, key_id, model, endpoint, pod,
    status, outcome, quota_checked, prompt_tokens, completion_tokens, charged_tokens,
    ttft_ms, duration_ms, queue_ms, cost_micros, currency, gpu_seconds)
SELECT 'req-' || i,
       now() - interval '30 days' + make_interval(secs => (s * 7919) % {SPAN_S} + i % 5 * 3),
       't' || CASE WHEN s % 10 = 0 THEN 1 + s / 10 % {HEAVY} ELSE 1 + s * 104729 % $1 END,
       'standard', 'sess-' || s, 'key_' || s % 1000, 'm' || i % 3, '/v1/chat/completions',
       '10.0.0.' || i % 8 || ':8000',
       CASE WHEN i % 50 = 0 THEN 429 ELSE 200 END,
       CASE WHEN i % 50 = 0 THEN 'refused' ELSE 'ok' END, true,
       100 + i % 400, 50 + i % 200, 150 + i % 400 + i % 200,
       50 + i % 300, 600 + i % 300 + i % 1000, CASE WHEN i % 4 = 0 THEN NULL ELSE i % 30 END,
       2 * (150 + i % 400 + i % 200), 'USD', (i % 100) / 100.0
FROM generate_series(0::bigint, $2 - 1) AS i, LATERAL (SELECT i / 5 AS s) AS g;
"""
BIG_SESSION = "sess-big"
FILL_BIG = f"""
INSERT INTO outcomes (request_id, ts, tenant, tier, session, model, endpoint, pod, status,
    outcome, prompt_tokens, completion_tokens, charged_tokens, ttft_ms, duration_ms,
    cost_micros, currency)
SELECT 'big-' || lpad(i::text, 9, '0'),
       now() - interval '2 days' + make_interval(secs => i * 172800.0 / $1),
       't1', 'standard', '{BIG_SESSION}', 'm0', '/v1/chat/completions', '10.0.0.1:8000', 200,
       'ok', 100, 50, 150, 80, 900, 300, 'USD'
FROM generate_series(0, $1 - 1) AS i;
"""

Call = Callable[[], Awaitable[int]]


async def main(n_tenants: int, per_tenant: int, n_outcomes: int, calls: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        pg = Postgres(Path(tmp) / "pg")
        pg.start(120)
        try:
            settings = Settings.model_validate({"database_url": pg.url, "admin_token": TOKEN})
            pool = await connect(settings)  # the schema: both services' migrations
            try:
                await fill(pg.url, n_tenants, per_tenant, n_outcomes)
                await serve_and_time(pool, n_tenants, n_outcomes, calls)
            finally:
                await pool.close()
        finally:
            pg.stop()


async def fill(url: str, n_tenants: int, per_tenant: int, n_outcomes: int) -> None:
    conn = await asyncpg.connect(url)
    try:
        started = time.perf_counter()
        await conn.execute(FILL.replace("$1", str(n_tenants)))
        await conn.execute(FILL_KEYS.replace("$1", str(n_tenants)).replace("$2", str(per_tenant)))
        keyed = time.perf_counter()
        await conn.execute(
            FILL_OUTCOMES.replace("$1", str(n_tenants)).replace("$2", str(n_outcomes))
        )
        await conn.execute(FILL_BIG.replace("$1", str(n_outcomes // 10)))
        await conn.execute("VACUUM ANALYZE")  # what autovacuum would have done by then
        rows = await conn.fetchval("SELECT count(*) FROM outcomes")
        print(
            f"filled {n_tenants} tenants, {n_tenants * per_tenant} keys in "
            f"{keyed - started:.0f} s; {rows} outcomes (one session of {n_outcomes // 10}) in "
            f"{time.perf_counter() - keyed:.0f} s"
        )
    finally:
        await conn.close()


async def serve_and_time(pool: asyncpg.Pool, n_tenants: int, n_outcomes: int, calls: int) -> None:
    admin = Admin(Store(pool, lambda: TierTable()), Reports(pool), TOKEN, 3600.0)
    runner = web.AppRunner(admin.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    base = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    jar = aiohttp.CookieJar(unsafe=True)  # the console's cookie on 127.0.0.1
    try:
        async with aiohttp.ClientSession(base, headers=auth, cookie_jar=jar) as http:
            async with http.post("/console/login", data={"token": TOKEN}) as r:
                assert r.status == 200 and "llmgw_console" in {c.key for c in jar}, r.status
            one = "t777"
            # A tenant of ordinary sessions (not a heavy one), and one of its sessions.
            row = await pool.fetchrow(
                "SELECT tenant, session FROM outcomes WHERE request_id = 'req-1005'"
            )
            small_tenant, small_session = row["tenant"], row["session"]
            made: list[str] = []

            def get(path: str, **params: str) -> Call:
                async def call() -> int:
                    async with http.get(path, params=params) as r:
                        await r.read()
                        return r.status

                return call

            async def create_key() -> int:
                async with http.post(f"/admin/v1/tenants/{one}/keys", json={}) as r:
                    made.append((await r.json())["id"])
                    return r.status

            async def revoke_key() -> int:
                async with http.delete(f"/admin/v1/keys/{made.pop()}") as r:
                    await r.read()
                    return r.status

            middle = f"big-{n_outcomes // 10 // 2:09d}"  # the big session's middle request
            cases: dict[str, Call] = {
                "GET tenants (first page, 100)": get("/admin/v1/tenants"),
                "GET tenants (a page deep in the list)": get(
                    "/admin/v1/tenants", after=f"t{n_tenants - 500}"
                ),
                f"GET tenants/{one}": get(f"/admin/v1/tenants/{one}"),
                f"GET tenants/{one}/keys": get(f"/admin/v1/tenants/{one}/keys"),
                f"POST tenants/{one}/keys (create)": create_key,
                "DELETE keys/{id} (revoke)": revoke_key,
                "GET usage (default window, by tenant)": get("/admin/v1/usage"),
                "GET usage (by tenant, a page deep in the list)": get(
                    "/admin/v1/usage", after=f"t{n_tenants // 2}"
                ),
                "GET usage?group_by=model": get("/admin/v1/usage", group_by="model"),
                f"GET usage?tenant={small_tenant}": get("/admin/v1/usage", tenant=small_tenant),
                "GET usage?tenant=t1 (heavy)": get("/admin/v1/usage", tenant="t1"),
                "GET usage?tenant=t1&group_by=day": get(
                    "/admin/v1/usage", tenant="t1", group_by="day"
                ),
                f"GET sessions/{small_session} (5 requests)": get(
                    f"/admin/v1/sessions/{small_session}"
                ),
                f"GET sessions/{BIG_SESSION} (first page)": get(
                    f"/admin/v1/sessions/{BIG_SESSION}"
                ),
                f"GET sessions/{BIG_SESSION} (a page in the middle)": get(
                    f"/admin/v1/sessions/{BIG_SESSION}", after=middle
                ),
                "console: tenants": get("/console/tenants"),
                f"console: tenants/{one}": get(f"/console/tenants/{one}"),
                f"console: tenants/{small_tenant}/usage": get(
                    f"/console/tenants/{small_tenant}/usage"
                ),
                "console: tenants/t1/usage (heavy)": get("/console/tenants/t1/usage"),
                f"console: sessions/{small_session}": get(f"/console/sessions/{small_session}"),
                f"console: sessions/{BIG_SESSION}": get(f"/console/sessions/{BIG_SESSION}"),
                "console: tiers": get("/console/tiers"),
            }
            width = max(map(len, cases))
            print(f"{'route (' + str(calls) + ' calls each)':<{width}}  p50 ms  p90 ms  max ms")
            for name, call in cases.items():
                ms, failed = await timed(call, calls)
                p50, p90 = percentile(ms, 0.5), percentile(ms, 0.9)
                status = f"  status {sorted(failed)}" if failed else ""
                print(
                    f"{name:<{width}}  {p50:6.1f}  {p90:6.1f}  {max(ms):6.1f}{status}", flush=True
                )
    finally:
        await runner.cleanup()


async def timed(call: Call, calls: int) -> tuple[list[float], set[int]]:
    """Each call's time in ms, after one more to warm it (not counted), and the statuses other
    than 200 (the database's command timeout answers 503)."""
    statuses = {await call()}
    spent = []
    for _ in range(calls):
        started = time.perf_counter()
        statuses.add(await call())
        spent.append((time.perf_counter() - started) * 1000)
    return spent, statuses - {200}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:5]]
    asyncio.run(main(*(args + [100_000, 10, 1_000_000, 20][len(args) :])))
