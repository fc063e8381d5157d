"""The durable ledger: outcome records and events into PostgreSQL, in batches, off the request
path.

`Ledger.submit()` never blocks: it appends to a bounded in-memory backlog (when full, the oldest
records are dropped and counted). One background task writes the backlog in batches, one
multi-row statement each (`INSERT … SELECT FROM unnest(…) ON CONFLICT (request_id) DO NOTHING`),
so a batch written twice (a retry after a timeout that did commit, a batch Envoy sent twice)
leaves one row per request. While the database is slow or down the batch goes back to the front
of the backlog and the task retries with bounded exponential backoff.

What can be lost: records dropped from a full backlog (`llmgw_ledger_dropped_total{reason=
"overflow"}`), what is still in memory when `close()`'s drain time runs out or the process dies
(`reason="shutdown"`, or nothing counted on SIGKILL), and records the database rejects as
invalid (`reason="rejected"`, isolated by splitting the batch). Events are not idempotent: one
retried after a commit whose answer was lost is written twice.

Schema migrations (`ledger/migrations/NNNN_name.sql`) are applied at `start()`, each file once
in its own transaction, under an advisory lock so that replicas starting together take turns.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import random
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from importlib import resources
from typing import Any

import asyncpg
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from llmgw.outcome import Outcome
from llmgw.serve import finish

log = logging.getLogger("ledger.db")

MIGRATIONS_LOCK = 0x6C6C6D67772D6C67  # pg_advisory_lock key: b"llmgw-lg"

# Outcome field → PostgreSQL array element type, in field order (the INSERT names its columns:
# those a later migration added follow written_at in the table).
COLUMN_TYPES: dict[str, str] = {
    "request_id": "text",
    "ts": "timestamptz",
    "tenant": "text",
    "tier": "text",
    "session": "text",
    "key_id": "text",
    "model": "text",
    "endpoint": "text",
    "pod": "text",
    "status": "int4",
    "flags": "text",
    "attempts": "int4",
    "stream": "bool",
    "outcome": "text",
    "prompt_tokens": "int8",
    "completion_tokens": "int8",
    "cached_tokens": "int8",
    "reserved_tokens": "int8",
    "charged_tokens": "int8",
    "cost_micros": "int8",
    "currency": "text",
    "gpu_seconds": "float8",
    "borrowed_requests": "int4",
    "borrowed_tokens": "int8",
    "quota_checked": "bool",
    "queue_ms": "float8",
    "ttft_ms": "float8",
    "duration_ms": "float8",
    "bytes_in": "int8",
    "bytes_out": "int8",
}
COLUMNS = tuple(COLUMN_TYPES)
INSERT_OUTCOMES = (
    f"INSERT INTO outcomes ({', '.join(COLUMNS)}) SELECT * FROM unnest("
    + ", ".join(f"${i}::{t}[]" for i, t in enumerate(COLUMN_TYPES.values(), 1))
    + ") ON CONFLICT (request_id) DO NOTHING"
)
INSERT_EVENTS = (
    "INSERT INTO ledger_events (ts, kind, tenant, detail) "
    "SELECT ts, kind, tenant, detail::jsonb "
    "FROM unnest($1::timestamptz[], $2::text[], $3::text[], $4::text[])"
    " AS e(ts, kind, tenant, detail)"
)

# SQLSTATE classes of a record the database will never accept (22 data exception, 23 integrity
# constraint violation): split the batch to isolate it, then drop it. Anything else is retried.
REJECTED_CLASSES = ("22", "23")


@dataclass(frozen=True)
class Migration:
    version: str  # the file name without .sql, e.g. "0001_outcomes"
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()


def migrations(package: str = "ledger") -> list[Migration]:
    """The schema migrations shipped in `package`/migrations/, in version order."""
    folder = resources.files(package) / "migrations"
    files = sorted((f for f in folder.iterdir() if f.name.endswith(".sql")), key=lambda f: f.name)
    return [Migration(f.name.removesuffix(".sql"), f.read_text()) for f in files]


class MigrationError(RuntimeError):
    """An applied migration's file changed since it was applied."""


async def migrate(
    conn: Any, available: Sequence[Migration] | None = None, table: str = "schema_migrations"
) -> list[str]:
    """Apply the migrations not yet in `table`; returns the versions applied now. Safe when
    several processes start at once: they take turns under an advisory lock. Each service's
    migrations (the ledger's by default, the admin's: admin/migrations/ into
    `admin_schema_migrations`) are numbered and tracked in a table of their own, one database."""
    available = migrations() if available is None else available
    applied_now: list[str] = []
    await conn.execute("SELECT pg_advisory_lock($1)", MIGRATIONS_LOCK)
    try:
        await conn.execute(
            f"CREATE TABLE IF NOT EXISTS {table} ("
            " version text PRIMARY KEY, checksum text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        )
        rows = await conn.fetch(f"SELECT version, checksum FROM {table}")
        done = {r["version"]: r["checksum"] for r in rows}
        for m in available:
            if m.version in done:
                if done[m.version] != m.checksum:
                    raise MigrationError(f"migration {m.version} changed after it was applied")
                continue
            async with conn.transaction():
                await conn.execute(m.sql)
                await conn.execute(
                    f"INSERT INTO {table} (version, checksum) VALUES ($1, $2)",
                    m.version,
                    m.checksum,
                )
            applied_now.append(m.version)
            log.info("migration applied", extra={"version": m.version, "table": table})
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", MIGRATIONS_LOCK)
    return applied_now


@dataclass(frozen=True)
class Event:
    """A row of `ledger_events`: a breaker trip or recovery, an alert (`detail` is JSON)."""

    kind: str
    tenant: str = ""
    detail: Mapping[str, Any] = field(default_factory=dict)
    ts: datetime = field(default_factory=lambda: datetime.now(UTC))


BATCH_BUCKETS = (1, 10, 50, 100, 250, 500, 1000, 2500, 5000, 10000)
WRITE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


@dataclass
class LedgerMetrics:
    """The ledger writer's Prometheus collectors (the service's registry by default)."""

    registry: CollectorRegistry = REGISTRY

    def __post_init__(self) -> None:
        r = self.registry
        self.backlog = Gauge(
            "llmgw_ledger_backlog_records", "Records waiting to be written", ["table"], registry=r
        )
        self.batch = Histogram(
            "llmgw_ledger_batch_records",
            "Outcome records per batch written",
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.write_seconds = Histogram(
            "llmgw_ledger_write_seconds",
            "Time of one successful batch write",
            buckets=WRITE_BUCKETS,
            registry=r,
        )
        self.written = Counter("llmgw_ledger_written", "Rows written", ["table"], registry=r)
        self.duplicates = Counter(
            "llmgw_ledger_duplicates",
            "Outcome records not written because their request ID was already there",
            registry=r,
        )
        self.dropped = Counter(
            "llmgw_ledger_dropped",
            "Records never written, by reason (overflow, rejected, shutdown, closed)",
            ["table", "reason"],
            registry=r,
        )
        self.failed_writes = Counter(
            "llmgw_ledger_failed_writes",
            "Batch writes that failed and will be retried (database slow or down)",
            registry=r,
        )


class Ledger:
    """The writer: `await start()`, then `submit()` from anywhere on the loop, `await close()`."""

    def __init__(
        self,
        database_url: str,
        *,
        backlog_max: int = 200_000,
        events_max: int = 10_000,
        batch_max: int = 5_000,
        connect_timeout_s: float = 5.0,
        command_timeout_s: float = 10.0,
        retry_base_s: float = 0.05,
        retry_max_s: float = 5.0,
        metrics: LedgerMetrics | None = None,
    ) -> None:
        self.database_url = database_url
        self.backlog_max = backlog_max
        self.events_max = events_max
        self.batch_max = batch_max
        self.connect_timeout_s = connect_timeout_s
        self.command_timeout_s = command_timeout_s
        self.retry_base_s = retry_base_s
        self.retry_max_s = retry_max_s
        self.metrics = metrics or LedgerMetrics()
        self._outcomes: deque[Outcome] = deque()
        self._writing: list[Outcome] = []
        self._events: deque[Event] = deque()
        self._wake = asyncio.Event()
        self._conn: Any = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._closed = False
        self.metrics.backlog.labels("outcomes").set_function(lambda: len(self._outcomes))
        self.metrics.backlog.labels("events").set_function(lambda: len(self._events))

    @property
    def backlog(self) -> int:
        """Outcome records waiting (not counting a batch being written)."""
        return len(self._outcomes)

    def holding(self, request_ids: set[str]) -> set[str]:
        """Which of these requests' records wait here to be written (ledger/reconcile.py)."""
        return {o.request_id for o in (*self._outcomes, *self._writing)} & request_ids

    # Life cycle.

    async def start(self, timeout_s: float = 30.0) -> None:
        """Connect and apply migrations (retrying until `timeout_s`), then start writing."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        failures = 0
        while True:
            try:
                conn = await self._connection()
                await migrate(conn)
                break
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as exc:
                await self._disconnect()
                failures += 1
                left = deadline - loop.time()
                if left <= 0:
                    raise TimeoutError(f"ledger database not usable after {timeout_s}s") from exc
                log.warning("ledger database not usable yet", extra={"error": repr(exc)})
                await asyncio.sleep(min(self._backoff(failures), left))
        self._task = asyncio.create_task(self._run(), name="ledger-writer")

    async def close(self, drain_s: float = 5.0) -> None:
        """Write what is left for up to `drain_s`, then stop; what remains is counted dropped."""
        self._closing = True
        self._wake.set()
        await finish(self._task, drain_s)
        self._closed = True
        self._drop("outcomes", "shutdown", len(self._outcomes))
        self._drop("events", "shutdown", len(self._events))
        self._outcomes.clear()
        self._events.clear()
        await self._disconnect()

    # Producers (never block, never raise on a full backlog).

    def submit(self, records: Sequence[Outcome]) -> None:
        if self._closed:
            self._drop("outcomes", "closed", len(records))
            return
        self._outcomes.extend(records)
        excess = len(self._outcomes) - self.backlog_max
        if excess > 0:
            for _ in range(excess):
                self._outcomes.popleft()
            self._drop("outcomes", "overflow", excess)
        self._wake.set()

    def submit_event(
        self,
        kind: str,
        tenant: str = "",
        detail: Mapping[str, Any] | None = None,
        ts: datetime | None = None,  # when it happened; None: now
    ) -> None:
        if self._closed:
            self._drop("events", "closed", 1)
            return
        event = Event(kind, tenant, dict(detail or {}))
        self._events.append(event if ts is None else replace(event, ts=ts))
        if len(self._events) > self.events_max:
            self._events.popleft()
            self._drop("events", "overflow", 1)
        self._wake.set()

    # The writer task.

    async def _run(self) -> None:
        failures = 0
        while True:
            if not self._outcomes and not self._events:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = [self._outcomes.popleft() for _ in range(min(self.batch_max, self.backlog))]
            self._writing = batch
            events = [self._events.popleft() for _ in range(min(self.batch_max, len(self._events)))]
            try:
                await self._write(batch, events)
                failures = 0
            except asyncio.CancelledError:
                self._put_back(batch, events)
                raise
            except Exception as exc:  # database slow or down, or anything else: the task lives on
                self._put_back(batch, events)
                failures += 1
                self.metrics.failed_writes.inc()
                log.warning(
                    "ledger write failed, will retry",
                    extra={"error": repr(exc), "backlog": self.backlog, "failures": failures},
                )
                await self._disconnect()
                await asyncio.sleep(self._backoff(failures))

    async def _write(self, batch: list[Outcome], events: list[Event]) -> None:
        conn = await self._connection()
        start = asyncio.get_running_loop().time()
        if batch:
            written, rejected = await self._insert_outcomes(conn, batch)
            self.metrics.written.labels("outcomes").inc(written)
            self.metrics.duplicates.inc(len(batch) - written - rejected)
            self._drop("outcomes", "rejected", rejected)
            self.metrics.batch.observe(len(batch))
        if events:
            await conn.execute(
                INSERT_EVENTS,
                [e.ts for e in events],
                [e.kind for e in events],
                [e.tenant for e in events],
                [json.dumps(e.detail, default=str) for e in events],
            )
            self.metrics.written.labels("events").inc(len(events))
        self.metrics.write_seconds.observe(asyncio.get_running_loop().time() - start)

    async def _insert_outcomes(self, conn: Any, batch: list[Outcome]) -> tuple[int, int]:
        """(rows inserted, records rejected); a rejected batch is halved until the bad records
        stand alone."""
        try:
            status = await conn.execute(INSERT_OUTCOMES, *columns(batch))
        except (asyncpg.PostgresError, ValueError) as exc:  # ValueError: could not encode
            state = str(getattr(exc, "sqlstate", ""))
            if not isinstance(exc, ValueError) and state[:2] not in REJECTED_CLASSES:
                raise
            if len(batch) == 1:
                log.error(
                    "ledger record rejected",
                    extra={"request_id": batch[0].request_id, "error": repr(exc)},
                )
                return 0, 1
            half = len(batch) // 2
            a = await self._insert_outcomes(conn, batch[:half])
            b = await self._insert_outcomes(conn, batch[half:])
            return a[0] + b[0], a[1] + b[1]
        return int(str(status).rsplit(" ", 1)[-1]), 0

    def _put_back(self, batch: list[Outcome], events: list[Event]) -> None:
        """Return a failed batch to the front; if new records filled the backlog meanwhile, the
        oldest (this batch's head) are the ones dropped."""
        room = max(0, self.backlog_max - len(self._outcomes))
        keep = batch[len(batch) - min(room, len(batch)) :]
        self._drop("outcomes", "overflow", len(batch) - len(keep))
        self._outcomes.extendleft(reversed(keep))
        room = max(0, self.events_max - len(self._events))
        kept_events = events[len(events) - min(room, len(events)) :]
        self._drop("events", "overflow", len(events) - len(kept_events))
        self._events.extendleft(reversed(kept_events))

    def _drop(self, table: str, reason: str, count: int) -> None:
        if count > 0:
            self.metrics.dropped.labels(table, reason).inc(count)

    def _backoff(self, failures: int) -> float:
        delay = min(self.retry_max_s, self.retry_base_s * 2.0 ** min(failures - 1, 30))
        return delay * random.uniform(0.5, 1.0)

    async def _connection(self) -> Any:
        if self._conn is None or self._conn.is_closed():
            self._conn = await asyncpg.connect(
                self.database_url,
                timeout=self.connect_timeout_s,
                command_timeout=self.command_timeout_s,
                server_settings={"application_name": "llmgw-ledger"},
            )
        return self._conn

    async def _disconnect(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and not conn.is_closed():
            try:
                await asyncio.wait_for(conn.close(), 1.0)
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError):
                conn.terminate()


def columns(batch: Sequence[Outcome]) -> list[list[Any]]:
    """The batch as one list per column (COLUMNS order), the unnest() arrays."""
    return [[getattr(r, name) for r in batch] for name in COLUMNS]
