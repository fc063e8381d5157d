"""Fixtures of the ledger tests: a real PostgreSQL (tools.postgres), a fresh database per test."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from prometheus_client import CollectorRegistry

from ledger.db import Ledger, LedgerMetrics
from llmgw.outcome import Outcome
from tools.postgres import Postgres

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


@pytest.fixture(scope="session")
def shared_pg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Postgres]:
    pg = Postgres(tmp_path_factory.mktemp("pg") / "postgres")
    pg.start(60)
    yield pg
    pg.stop()


@pytest.fixture
def own_pg(tmp_path: Path) -> Iterator[list[Postgres]]:
    """A server of this test's own, for tests that kill it; [-1] is the current one."""
    procs = [Postgres(tmp_path / "postgres")]
    procs[0].start(60)
    yield procs
    procs[-1].stop()


@pytest.fixture
async def db(shared_pg: Postgres) -> AsyncIterator[str]:
    """The URL of an empty database of this test's own on the shared server."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(shared_pg.url)
    try:
        await admin.execute(f"CREATE DATABASE {name}")
        yield shared_pg.url.rsplit("/", 1)[0] + f"/{name}"
        await admin.execute(f"DROP DATABASE {name} WITH (FORCE)")
    finally:
        await admin.close()


@pytest.fixture
async def make_ledger() -> AsyncIterator[Callable[..., Ledger]]:
    """make(url, **kwargs) → an unstarted Ledger with its own metrics registry; all closed."""
    made: list[Ledger] = []

    def make(url: str, **kwargs: Any) -> Ledger:
        kwargs.setdefault("metrics", LedgerMetrics(CollectorRegistry()))
        kwargs.setdefault("retry_max_s", 0.5)
        ledger = Ledger(url, **kwargs)
        made.append(ledger)
        return ledger

    yield make
    for ledger in made:
        await ledger.close(1.0)


def outcome(i: int, **fields: Any) -> Outcome:
    values: dict[str, Any] = {
        "request_id": f"req-{i:06d}",
        "ts": T0 + timedelta(milliseconds=i),
        "tenant": "acme",
        "outcome": "ok",
        "status": 200,
    }
    return Outcome(**{**values, **fields})


def metric(ledger: Ledger, name: str, **labels: str) -> float:
    value = ledger.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def rows(url: str, sql: str, *args: Any) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(url)
    try:
        return list(await conn.fetch(sql, *args))
    finally:
        await conn.close()
