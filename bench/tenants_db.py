"""The tenants database source at scale (extauthz/follower.py): start-up, one change, the cache,
memory, and the check's CPU per request there against a snapshot of 3 tenants.
`python -m bench.tenants_db [TENANTS] [KEYS_PER_TENANT]` (100,000 × 10 by default).

A PostgreSQL of its own (tools.postgres) is filled server-side (generate_series), then a
follower starts from it; one tenant is changed as the admin API changes it and the read that
applies it is timed, against a copy of the whole key dict (what a MappingProxyType snapshot
would cost per change)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import resource
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path

import asyncpg

from admin.__main__ import connect
from admin.settings import Settings
from admin.store import Store
from admin.types import PageRequest
from extauthz.catalog import Catalog
from extauthz.decision import Decider
from extauthz.follower import TenantsFollower
from extauthz.sessions import SessionCodec, Sessions
from extauthz.settings import DecisionSettings
from extauthz.types import Allow, ApiKey, Snapshot, Tenant
from llmgw.tiers import TierTable
from tools.postgres import Postgres

FILL = """
INSERT INTO tenants (id, spec)
SELECT 't' || i, jsonb_build_object('id', 't' || i, 'name', 'T' || i, 'tier', 'standard',
                                    'priority', 5, 'models', '*')
FROM generate_series(1, $1) AS i;
"""
FILL_KEYS = """
INSERT INTO api_keys (id, tenant, sha256, prefix, created)
SELECT 'key_' || lpad(to_hex(i), 12, '0'), 't' || (1 + i % $1),
       encode(sha256(('sk-llmgw-k' || i)::bytea), 'hex'), 'sk-llmgw-abcd', now()
FROM generate_series(0, $1 * $2 - 1) AS i;
"""


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def main(n_tenants: int, per_tenant: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        pg = Postgres(Path(tmp) / "pg")
        pg.start(120)
        try:
            # The admin API's pool: its migrations make the schema (admin/migrations/).
            secret = "9f2c41e8a7b3d6055f1e2a9c0b7d64e3"
            pool = await connect(
                Settings.model_validate({"database_url": pg.url, "admin_token": secret})
            )
            conn = await asyncpg.connect(pg.url)
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
            check_cpu(follower.current, catalog.snapshot.tiers)
            await admin_times(Store(pool, lambda: catalog.snapshot.tiers), n_tenants)
            await pool.close()
            await conn.close()
            await follower.close()
        finally:
            pg.stop()


async def admin_times(store: Store, n_tenants: int, calls: int = 20) -> None:
    """The admin API's store on this data (what its routes and the console's pages ask of the
    database): a page of tenants first and last, a tenant, its keys, a key made (a change)."""
    last = f"t{n_tenants - 50}"
    cases: dict[str, Callable[[], Awaitable[object]]] = {
        "tenants, first page (100)": lambda: store.tenants(PageRequest(100)),
        "tenants, a page deep in the list": lambda: store.tenants(PageRequest(100, last)),
        "a tenant": lambda: store.tenant("t777"),
        "a tenant's keys": lambda: store.keys("t777", PageRequest(100)),
        "a key made (row, rev, notify, audit)": lambda: store.create_key("t777", None),
    }
    for name, call in cases.items():
        started = time.perf_counter()
        for _ in range(calls):
            await call()
        print(f"admin store, {name}: {(time.perf_counter() - started) * 1000 / calls:.1f} ms")


def check_cpu(big: Snapshot, tiers: TierTable, rounds: int = 6, calls: int = 2_000) -> None:
    """The decision's CPU per chat request (key lookup, body, facts, session) with this many
    tenants against 3, in alternating rounds (the machine's drift weighs on both alike)."""
    key = "sk-llmgw-k0"  # the database's first key: tenant t1's
    record = ApiKey(
        id="key_000000000000",
        sha256=hashlib.sha256(key.encode()).hexdigest(),
        prefix="sk-llmgw-abcd",
        created=datetime.now(UTC),
    )
    spec = {"name": "T", "tier": "standard", "priority": 5, "models": "*"}
    few = [Tenant(id=f"t{i}", keys=(record,) if i == 1 else (), **spec) for i in (1, 2, 3)]  # type: ignore[arg-type]
    small = Catalog.build(few, tiers).snapshot
    secret = "9f2c41e8a7b3d6055f1e2a9c0b7d64e3"
    decider = Decider(DecisionSettings(), Sessions(SessionCodec(secret.encode()), 0))
    headers = {":path": "/v1/chat/completions", ":method": "POST", "authorization": f"Bearer {key}"}
    body = json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi " * 40}]}
    ).encode()
    spent = {"big": 0.0, "small": 0.0}
    for r in range(rounds):
        for name, snap in (("big", big), ("small", small))[:: 1 if r % 2 else -1]:
            assert isinstance(decider.decide(snap, headers, body, time.time()), Allow)
            started = time.process_time()
            for _ in range(calls):
                decider.decide(snap, headers, body, time.time())
            spent[name] += time.process_time() - started
    per = {k: v / (rounds * calls) * 1e6 for k, v in spent.items()}
    print(
        f"check CPU per request (the decision): {len(big.tenants)} tenants {per['big']:.1f} µs, "
        f"3 tenants {per['small']:.1f} µs: {per['big'] / per['small']:.3f}x"
    )


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:3]]
    asyncio.run(main(*(args + [100_000, 10][len(args) :])))
