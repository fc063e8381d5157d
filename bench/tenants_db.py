"""The tenants database source at scale (extauthz/follower.py): start-up, one change, the cache,
memory. `python -m bench.tenants_db [TENANTS] [KEYS_PER_TENANT]` (100,000 × 10 by default).

A PostgreSQL of its own (tools.postgres) is filled server-side (generate_series), then a
follower starts from it; one tenant is changed as the admin API changes it and the read that
applies it is timed, against a copy of the whole key dict (what a MappingProxyType snapshot
would cost per change)."""

from __future__ import annotations

import asyncio
import resource
import sys
import tempfile
import time
from pathlib import Path

import asyncpg

from extauthz.follower import TenantsFollower
from tools.postgres import Postgres

SCHEMA = Path(__file__).parents[1] / "admin" / "migrations" / "0001_admin.sql"
FILL = """
INSERT INTO tenants (id, spec)
SELECT 't' || i, jsonb_build_object('id', 't' || i, 'name', 'T' || i, 'tier', 'standard',
                                    'priority', 5, 'models', '*')
FROM generate_series(1, $1) AS i;
"""
FILL_KEYS = """
INSERT INTO api_keys (id, tenant, sha256, prefix, created)
SELECT 'key_' || lpad(to_hex(i), 12, '0'), 't' || (1 + i % $1),
       encode(sha256(('k' || i)::bytea), 'hex'), 'sk-llmgw-abcd', now()
FROM generate_series(0, $1 * $2 - 1) AS i;
"""


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def main(n_tenants: int, per_tenant: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        pg = Postgres(Path(tmp) / "pg")
        pg.start(120)
        try:
            conn = await asyncpg.connect(pg.url)
            await conn.execute(SCHEMA.read_text())
            started = time.perf_counter()
            await conn.execute(FILL.replace("$1", str(n_tenants)))
            await conn.execute(
                FILL_KEYS.replace("$1", str(n_tenants)).replace("$2", str(per_tenant))
            )
            print(
                f"filled {n_tenants} tenants, {n_tenants * per_tenant} keys: "
                f"{time.perf_counter() - started:.1f} s"
            )
            base = rss_mib()
            started = time.perf_counter()
            follower = await TenantsFollower.open(pg.url, Path(tmp) / "cache.yaml", None)
            print(
                f"start-up (read, validate, build): {time.perf_counter() - started:.2f} s; "
                f"peak RSS +{rss_mib() - base:.0f} MiB"
            )
            started = time.perf_counter()
            text = follower.catalog.text()
            print(
                f"cache text: {len(text) / 2**20:.0f} MiB, built in "
                f"{time.perf_counter() - started:.2f} s"
            )
            # One change: a tenant's keys revoked, as the admin API does (row, rev, notify).
            follower._resynced = time.monotonic()  # a steady state: not the periodic full read
            follower._marks.clear()
            follower._marks.append(
                (time.monotonic() - 60, await conn.fetchval("SELECT max(rev) FROM tenants"))
            )
            await conn.execute("UPDATE api_keys SET revoked = true WHERE tenant = 't7'")
            await conn.execute(
                "UPDATE tenants SET rev = nextval('tenant_revisions') WHERE id = 't7'"
            )
            started = time.perf_counter()
            changed = await follower.sync()
            sync_ms = (time.perf_counter() - started) * 1000
            catalog = follower.catalog
            started = time.perf_counter()
            for _ in range(20):
                catalog.apply({"t7": None}, catalog.snapshot.tiers)
            apply_ms = (time.perf_counter() - started) * 1000 / 20
            keys = dict(catalog.keys.items())
            started = time.perf_counter()
            for _ in range(5):
                dict(keys)
            copy_ms = (time.perf_counter() - started) * 1000 / 5
            print(
                f"one change ({changed} tenant): read + apply {sync_ms:.1f} ms; apply alone "
                f"{apply_ms:.2f} ms; a copy of every key (the dict alternative) {copy_ms:.1f} ms"
            )
            await conn.close()
            await follower.close()
        finally:
            pg.stop()


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:3]]
    asyncio.run(main(*(args + [100_000, 10][len(args) :])))
