"""The ledger writer against a real PostgreSQL: migrations, idempotence, outages, overflow."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import asyncpg
import pytest

from ledger.db import COLUMNS, Ledger, Migration, MigrationError, migrate, migrations
from llmgw.outcome import Outcome
from tests.eventually import eventually_async
from tests.ledger.conftest import metric, outcome, rows
from tools.postgres import Postgres

MakeLedger = Callable[..., Ledger]


async def test_migrations_apply_once(db: str) -> None:
    conn = await asyncpg.connect(db)
    try:
        first = await migrate(conn)
        second = await migrate(conn)
    finally:
        await conn.close()
    assert first == [m.version for m in migrations()] and first
    assert second == []
    applied = await rows(db, "SELECT version FROM schema_migrations ORDER BY version")
    assert [r["version"] for r in applied] == first


async def test_outcomes_table_has_a_column_per_outcome_field(db: str) -> None:
    conn = await asyncpg.connect(db)
    try:
        await migrate(conn)
    finally:
        await conn.close()
    found = await rows(
        db,
        "SELECT column_name FROM information_schema.columns WHERE table_name = 'outcomes'"
        " ORDER BY ordinal_position",
    )
    # Columns a later migration added follow written_at; the INSERT names them.
    # Every field but an excluded one (what settlement reads and nothing stores).
    columns = tuple(n for n, f in Outcome.model_fields.items() if not f.exclude)
    assert sorted(r["column_name"] for r in found) == sorted([*columns, "written_at"])
    assert columns == COLUMNS


async def test_a_record_reads_back_as_written(db: str, make_ledger: MakeLedger) -> None:
    ledger = make_ledger(db)
    await ledger.start()
    written = outcome(1, borrowed_requests=1, borrowed_tokens=120, charged_tokens=150)
    ledger.submit([written, outcome(2)])
    await eventually_async(
        lambda: metric(ledger, "llmgw_ledger_written_total", table="outcomes") == 2, 30.0
    )
    found = await rows(db, f"SELECT {', '.join(COLUMNS)} FROM outcomes ORDER BY request_id")
    assert [Outcome(**dict(r)) for r in found] == [written, outcome(2)]


async def test_replicas_migrating_at_once_take_turns(db: str) -> None:
    """Without the advisory lock the concurrent CREATE TABLEs fail (duplicate pg_type key)."""
    conns = [await asyncpg.connect(db) for _ in range(4)]
    try:
        results = await asyncio.gather(*(migrate(c) for c in conns))
    finally:
        for c in conns:
            await c.close()
    assert sorted(len(r) for r in results) == [0, 0, 0, len(migrations())]
    count = await rows(db, "SELECT count(*) AS n FROM schema_migrations")
    assert count[0]["n"] == len(migrations())


async def test_a_changed_migration_is_refused(db: str) -> None:
    conn = await asyncpg.connect(db)
    try:
        await migrate(conn)
        edited = [Migration(m.version, m.sql + "\n-- edited\n") for m in migrations()]
        with pytest.raises(MigrationError, match=migrations()[0].version):
            await migrate(conn, edited)
    finally:
        await conn.close()


async def test_a_batch_submitted_twice_is_written_once(db: str, make_ledger: MakeLedger) -> None:
    ledger = make_ledger(db)
    await ledger.start()
    batch = [outcome(i, completion_tokens=i) for i in range(500)]
    ledger.submit(batch)
    ledger.submit(batch)  # e.g. Envoy resending a batch
    ledger.submit(batch[100:200])
    done = 500 + 500 + 100

    def settled() -> bool:
        seen = metric(ledger, "llmgw_ledger_written_total", table="outcomes")
        return seen + metric(ledger, "llmgw_ledger_duplicates_total") == done

    await eventually_async(settled, 30.0, "every record written or counted as duplicate")
    assert metric(ledger, "llmgw_ledger_written_total", table="outcomes") == 500
    assert metric(ledger, "llmgw_ledger_duplicates_total") == 600
    found = await rows(db, "SELECT count(*) AS n, sum(completion_tokens) AS s FROM outcomes")
    assert (found[0]["n"], found[0]["s"]) == (500, sum(range(500)))


async def test_nothing_is_lost_while_the_database_is_down(
    own_pg: list[Postgres], make_ledger: MakeLedger
) -> None:
    pg = own_pg[0]
    ledger = make_ledger(pg.url, batch_max=200, connect_timeout_s=1.0)
    await ledger.start()
    ledger.submit([outcome(i) for i in range(1000)])
    written = "llmgw_ledger_written_total"
    await eventually_async(
        lambda: metric(ledger, written, table="outcomes") == 1000, 30.0, "first writes"
    )

    pg.kill()  # SIGKILL the postmaster
    for start in range(1000, 3000, 250):  # traffic goes on while it is down
        ledger.submit([outcome(i) for i in range(start, start + 250)])
        await asyncio.sleep(0)
    await eventually_async(
        lambda: metric(ledger, "llmgw_ledger_failed_writes_total") >= 2, 30.0, "failed writes"
    )
    assert metric(ledger, "llmgw_ledger_backlog_records", table="outcomes") == 2000
    assert ledger.backlog == 2000

    own_pg.append(pg.fresh())  # the same data directory, port and password
    own_pg[-1].start(60)
    await eventually_async(
        lambda: metric(ledger, written, table="outcomes") == 3000, 30.0, "backlog written"
    )
    assert metric(ledger, "llmgw_ledger_backlog_records", table="outcomes") == 0
    found = await rows(pg.url, "SELECT request_id FROM outcomes ORDER BY request_id")
    assert [r["request_id"] for r in found] == [outcome(i).request_id for i in range(3000)]
    assert metric(ledger, "llmgw_ledger_dropped_total", table="outcomes", reason="overflow") == 0


async def test_a_full_backlog_drops_the_oldest(db: str, make_ledger: MakeLedger) -> None:
    ledger = make_ledger(db, backlog_max=100)
    ledger.submit([outcome(i) for i in range(60)])  # not started: nothing is written yet
    ledger.submit([outcome(i) for i in range(60, 150)])
    assert ledger.backlog == 100
    dropped = metric(ledger, "llmgw_ledger_dropped_total", table="outcomes", reason="overflow")
    assert dropped == 50
    await ledger.start()
    await eventually_async(
        lambda: metric(ledger, "llmgw_ledger_written_total", table="outcomes") == 100, 30.0
    )
    found = await rows(db, "SELECT request_id FROM outcomes ORDER BY request_id")
    assert [r["request_id"] for r in found] == [outcome(i).request_id for i in range(50, 150)]


async def test_close_drains_the_backlog(db: str, make_ledger: MakeLedger) -> None:
    ledger = make_ledger(db, batch_max=100)
    await ledger.start()
    ledger.submit([outcome(i) for i in range(1000)])
    await ledger.close(30.0)
    found = await rows(db, "SELECT count(*) AS n FROM outcomes")
    assert found[0]["n"] == 1000
    ledger.submit([outcome(5000)])
    assert metric(ledger, "llmgw_ledger_dropped_total", table="outcomes", reason="closed") == 1


async def test_an_invalid_record_is_rejected_alone(db: str, make_ledger: MakeLedger) -> None:
    ledger = make_ledger(db)
    await ledger.start()
    bad = outcome(7, status=2**31)  # out of integer range: SQLSTATE 22003
    ledger.submit([*(outcome(i) for i in range(7)), bad, *(outcome(i) for i in range(8, 20))])
    await eventually_async(
        lambda: metric(ledger, "llmgw_ledger_written_total", table="outcomes") == 19, 30.0
    )
    assert metric(ledger, "llmgw_ledger_dropped_total", table="outcomes", reason="rejected") == 1


async def test_events_are_written(db: str, make_ledger: MakeLedger) -> None:
    ledger = make_ledger(db)
    await ledger.start()
    ledger.submit_event("breaker_trip", "acme", {"score": 0.7, "tier": "free"})
    ledger.submit_event("breaker_recovery", "acme")
    await eventually_async(
        lambda: metric(ledger, "llmgw_ledger_written_total", table="events") == 2, 30.0
    )
    found = await rows(db, "SELECT kind, tenant, detail::text AS d FROM ledger_events ORDER BY id")
    assert [(r["kind"], r["tenant"]) for r in found] == [
        ("breaker_trip", "acme"),
        ("breaker_recovery", "acme"),
    ]
    assert '"score": 0.7' in found[0]["d"]
