"""Fixtures of the ledger tests (their PostgreSQL: tests/conftest.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest
from prometheus_client import CollectorRegistry

from ledger.db import Ledger, LedgerMetrics
from llmgw.outcome import Outcome

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


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
