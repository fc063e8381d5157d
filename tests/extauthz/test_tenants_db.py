"""The tenants followed from PostgreSQL (extauthz/follower.py) against a real server, changed as
the admin API changes them (admin/migrations/0001_admin.sql): a row, a rev from the sequence and
pg_notify in one transaction."""

from __future__ import annotations

import asyncio
import json
import logging
import stat
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import REGISTRY

from extauthz import tenants
from extauthz.director import Director
from extauthz.follower import StartError, TenantsFollower
from extauthz.types import ApiKey, Tenant
from tests.eventually import eventually_async
from tests.extauthz.conftest import NOW, make_decider
from tools.postgres import Postgres

SCHEMA = Path(__file__).parents[2] / "admin" / "migrations" / "0001_admin.sql"
# The follower's bound is the notification's delivery, else its 1 s poll (the 2 s):
# a busy machine gets more before a test gives up (polls here are every 60 s where only the
# notification may bring a change, so the bound still tells the two apart).
WITHIN_S = 10.0
Open = Callable[..., Awaitable[TenantsFollower]]


def tenant(tenant_id: str, tier: str = "standard") -> Tenant:
    return Tenant(id=tenant_id, name=tenant_id.title(), tier=tier, priority=5, models="*")


async def put(conn: Any, t: Tenant, *keys: ApiKey) -> int:
    """What the admin API does: the tenant and its keys, a new rev, the notification."""
    async with conn.transaction():
        spec = t.model_dump_json(exclude={"keys"})
        await conn.execute(
            "INSERT INTO tenants (id, spec) VALUES ($1, $2::jsonb) ON CONFLICT (id) DO UPDATE"
            " SET spec = excluded.spec, deleted = false",
            t.id,
            spec,
        )
        for k in keys:
            await conn.execute(
                "INSERT INTO api_keys (id, tenant, sha256, prefix, created, expires, revoked)"
                " VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (id) DO UPDATE"
                " SET revoked = excluded.revoked, expires = excluded.expires",
                k.id,
                t.id,
                k.sha256,
                k.prefix,
                k.created,
                k.expires,
                k.revoked,
            )
        return await bump(conn, t.id)


async def bump(conn: Any, tenant_id: str, deleted: bool = False) -> int:
    rev: int = await conn.fetchval(
        "UPDATE tenants SET rev = nextval('tenant_revisions'), updated = now(),"
        " deleted = deleted OR $2 WHERE id = $1 RETURNING rev",
        tenant_id,
        deleted,
    )
    await conn.execute("SELECT pg_notify('llmgw_tenants', $1)", str(rev))
    return rev


def director(source: TenantsFollower) -> Director:
    return Director(source, make_decider(), TracerProvider().get_tracer("t"))


def works(source: TenantsFollower, api_key: str) -> bool:
    """The Director's reading of the key: its tenant, or a refusal."""
    return director(source).key({"authorization": f"Bearer {api_key}"}).status == 200


@pytest.fixture
async def admin(db: str) -> AsyncIterator[Any]:
    conn = await asyncpg.connect(db)
    await conn.execute(SCHEMA.read_text())
    yield conn
    await conn.close()


@pytest.fixture
async def open_follower(tmp_path: Path) -> AsyncIterator[Open]:
    """open(url, **kwargs) → a started follower, following until the test ends."""
    tasks: list[asyncio.Task[None]] = []

    async def open_(
        url: str, cache: Path | None = None, tiers_file: Path | None = None, **kwargs: Any
    ) -> TenantsFollower:
        kwargs.setdefault("connect_timeout_s", 2.0)
        follower = await TenantsFollower.open(
            url, cache or tmp_path / "tenants-cache.yaml", tiers_file, **kwargs
        )
        tasks.append(asyncio.create_task(follower.run()))
        return follower

    yield open_
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def new_key(**kwargs: Any) -> tuple[str, ApiKey]:
    return tenants.new_key(NOW - timedelta(days=1), **kwargs)


async def test_a_key_created_works_within_2s_by_notification(
    db: str, admin: Any, open_follower: Open
) -> None:
    """Polling every 60 s: only the notification can bring the key within 2 s."""
    follower = await open_follower(db, poll_seconds=60.0)
    await asyncio.sleep(0.2)  # the follower waits on its notification
    api_key, record = new_key()
    await put(admin, tenant("acme"), record)
    await eventually_async(lambda: works(follower, api_key), WITHIN_S, "the new key works")


async def test_without_notifications_polling_converges(
    db: str, admin: Any, open_follower: Open
) -> None:
    follower = await open_follower(db, poll_seconds=1.0, listen=False)
    api_key, record = new_key()
    await put(admin, tenant("acme"), record)
    await eventually_async(lambda: works(follower, api_key), WITHIN_S, "polled")


async def test_a_revoked_key_and_a_deleted_tenant_stop_within_2s(
    db: str, admin: Any, open_follower: Open
) -> None:
    kept, kept_record = new_key()
    revoked, revoked_record = new_key()
    gone, gone_record = new_key()
    await put(admin, tenant("acme"), kept_record, revoked_record)
    await put(admin, tenant("globex"), gone_record)
    follower = await open_follower(db, poll_seconds=60.0)
    assert works(follower, kept) and works(follower, revoked) and works(follower, gone)
    await put(admin, tenant("acme"), revoked_record.model_copy(update={"revoked": True}))
    await bump(admin, "globex", deleted=True)
    await eventually_async(lambda: not works(follower, revoked), WITHIN_S, "revoked")
    await eventually_async(lambda: not works(follower, gone), WITHIN_S, "deleted tenant's key")
    assert works(follower, kept)
    assert "globex" not in follower.current.tenants


async def test_two_replicas_both_see_a_change(
    db: str, admin: Any, open_follower: Open, tmp_path: Path
) -> None:
    one = await open_follower(db, tmp_path / "one.yaml")
    two = await open_follower(db, tmp_path / "two.yaml")
    api_key, record = new_key()
    await put(admin, tenant("acme"), record)
    await eventually_async(lambda: works(one, api_key) and works(two, api_key), WITHIN_S)


async def test_a_rev_committed_after_a_later_one_is_not_missed(
    db: str, admin: Any, open_follower: Open
) -> None:
    """Writer A takes its rev, writer B a later one and commits first: a reader that reads past
    the highest rev it saw would never read A's. (settle_s short: past the first seconds, when
    every poll reads every rev.)"""
    await put(admin, tenant("acme"))
    await put(admin, tenant("globex"))
    follower = await open_follower(db, poll_seconds=0.2, settle_s=1.0)
    await asyncio.sleep(1.5)  # past settle_s: reads go back only to the last second's revs
    late_key, late_record = new_key()
    soon_key, soon_record = new_key()
    other = await asyncpg.connect(db)
    try:
        slow = other.transaction()
        await slow.start()
        await put(other, tenant("acme"), late_record)  # its rev taken, not committed
        await put(admin, tenant("globex"), soon_record)  # a later rev, committed
        await eventually_async(lambda: works(follower, soon_key), WITHIN_S)
        await asyncio.sleep(0.4)  # a poll or two past the later rev
        await slow.commit()
    finally:
        await other.close()
    await eventually_async(lambda: works(follower, late_key), WITHIN_S, "the earlier rev")


async def test_a_bad_row_is_skipped_and_the_rest_load(
    db: str, admin: Any, open_follower: Open, caplog: pytest.LogCaptureFixture
) -> None:
    good, good_record = new_key()
    bad_key_of_good, bad_record = new_key()
    await put(admin, tenant("acme"), good_record)
    await put(admin, tenant("unknown-tier", tier="nonesuch"), new_key()[1])
    await admin.execute(
        "INSERT INTO tenants (id, spec) VALUES ('broken', $1::jsonb)",
        json.dumps(
            {"id": "broken", "name": "B", "tier": "standard", "priority": 99, "models": "*"}
        ),
    )
    await admin.execute(  # a key row the model refuses (its prefix is not a key's)
        "INSERT INTO api_keys (id, tenant, sha256, prefix, created)"
        " VALUES ($1, 'acme', $2, 'x', now())",
        bad_record.id,
        bad_record.sha256,
    )
    with caplog.at_level(logging.ERROR, "extauthz"):
        follower = await open_follower(db)
    assert set(follower.current.tenants) == {"acme"}
    assert works(follower, good) and not works(follower, bad_key_of_good)
    skipped = {(r.getMessage(), getattr(r, "tenant", None)) for r in caplog.records}
    assert ("tenants database: tenant skipped", "broken") in skipped
    assert ("tenants database: key skipped", "acme") in skipped
    assert ("tenants database: tenant's keys refused: unknown tier", "unknown-tier") in skipped


async def test_the_cache_holds_hashes_only_and_is_0600(
    db: str, admin: Any, open_follower: Open, tmp_path: Path
) -> None:
    cache = tmp_path / "cache.yaml"
    first, first_record = new_key()
    await put(admin, tenant("acme"), first_record)
    follower = await open_follower(db, cache)
    await eventually_async(cache.exists, WITHIN_S)
    second, second_record = new_key()
    await put(admin, tenant("globex"), second_record)
    await eventually_async(lambda: second_record.sha256 in cache.read_text(), WITHIN_S, "rewritten")
    text = cache.read_text()
    assert stat.S_IMODE(cache.stat().st_mode) == 0o600
    assert first not in text and second not in text and first_record.sha256 in text
    data = tenants.read(cache)  # the tenants file's format: a file source could serve it
    assert {t.id: [k.id for k in t.keys] for t in data.tenants} == {
        "acme": [first_record.id],
        "globex": [second_record.id],
    }
    assert works(follower, second)


async def test_the_database_stopped_the_snapshot_serves_and_a_restart_uses_the_cache(
    own_pg: list[Postgres], open_follower: Open, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = own_pg[0].url
    conn = await asyncpg.connect(url)
    await conn.execute(SCHEMA.read_text())
    api_key, record = new_key()
    await put(conn, tenant("acme"), record)
    await conn.close()
    cache = tmp_path / "cache.yaml"
    follower = await open_follower(url, cache, poll_seconds=0.2)
    await eventually_async(cache.exists, WITHIN_S)
    own_pg[0].stop()
    await eventually_async(lambda: not follower.up, 10.0, "the follower sees the outage")
    synced = follower.synced_at
    assert REGISTRY.get_sample_value("llmgw_extauthz_tenants_source_up") == 0
    await asyncio.sleep(0.5)
    assert works(follower, api_key) and follower.synced_at == synced  # stale, still serving
    with caplog.at_level(logging.WARNING, "extauthz"):
        restarted = await open_follower(url, cache)
    assert works(restarted, api_key) and not restarted.up
    assert any("serving the cached snapshot" in r.getMessage() for r in caplog.records)
    # The database back: the restarted one reads it whole, then follows it.
    own_pg.append(own_pg[0].fresh())
    own_pg[-1].start(60)
    later, later_record = new_key()
    conn = await asyncpg.connect(url)
    try:
        await put(conn, tenant("globex"), later_record)
    finally:
        await conn.close()
    await eventually_async(lambda: works(restarted, later), 15.0, "followed again")
    assert restarted.up and works(restarted, api_key)


async def test_neither_database_nor_cache_fails_the_start(tmp_path: Path) -> None:
    with pytest.raises(StartError, match="cache"):
        await TenantsFollower.open(
            "postgresql://nobody:x@127.0.0.1:1/none",
            tmp_path / "none.yaml",
            None,
            connect_timeout_s=1.0,
        )


async def test_a_change_this_replica_cannot_read_fails_closed(
    admin: Any, db: str, open_follower: Open
) -> None:
    """A tenant moved to a tier this replica does not know yet, with its key revoked in the same
    change, or a row that does not validate: the old key must not keep working."""
    follower = await open_follower(db, poll_seconds=0.2)
    moved_key, moved = new_key()
    broken_key, broken = new_key()
    await put(admin, tenant("mover"), moved)
    await put(admin, tenant("breaker"), broken)
    await eventually_async(
        lambda: works(follower, moved_key) and works(follower, broken_key), WITHIN_S
    )
    await put(admin, tenant("mover", tier="gold"), moved.model_copy(update={"revoked": True}))
    async with admin.transaction():
        await admin.execute("UPDATE tenants SET spec = '{\"id\": 3}' WHERE id = 'breaker'")
        await bump(admin, "breaker")
    await eventually_async(lambda: not works(follower, moved_key), WITHIN_S, "unknown tier")
    await eventually_async(lambda: not works(follower, broken_key), WITHIN_S, "bad row")


async def test_a_tier_that_goes_and_comes_back_brings_its_tenants_back(
    admin: Any, db: str, open_follower: Open, tmp_path: Path
) -> None:
    tiers = tmp_path / "tiers.yaml"
    with_gold = "tiers:\n  gold: {requests: {minute: 600}, tokens: {minute: 900000}}\n"
    tiers.write_text(with_gold)
    follower = await open_follower(db, tiers_file=tiers, poll_seconds=0.2)
    api_key, key = new_key()
    await put(admin, tenant("golden", tier="gold"), key)
    await eventually_async(lambda: works(follower, api_key), WITHIN_S, "on gold")
    tiers.write_text("tiers: {}\n")
    await eventually_async(lambda: not works(follower, api_key), WITHIN_S, "gold gone")
    tiers.write_text(with_gold + "# again\n")
    await eventually_async(lambda: works(follower, api_key), WITHIN_S, "gold back")
