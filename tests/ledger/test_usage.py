"""`llmgw usage` against rows written through the ledger writer."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from ledger.db import Ledger
from llmgw.outcome import JSON_FIELDS, Outcome
from tests.eventually import eventually_async
from tests.ledger.conftest import metric
from tools import cli, usage
from tools.postgres import Postgres

NOW = datetime.now(UTC).replace(microsecond=0)
BASE = NOW - timedelta(hours=1)


def rec(n: int, **fields: object) -> Outcome:
    values: dict[str, object] = {"request_id": f"req-{n}", "status": 200, "outcome": "ok"}
    return Outcome.model_validate({**values, **fields})


DATASET = [
    rec(1, ts=BASE + timedelta(seconds=3), tenant="acme", session="s1", model="m1", pod="p1",
        prompt_tokens=10, completion_tokens=20, charged_tokens=30, queue_ms=0.0,
        ttft_ms=100.0, borrowed_requests=1, borrowed_tokens=12, cost_micros=1234,
        currency="USD", gpu_seconds=0.0523),
    rec(2, ts=BASE + timedelta(seconds=1), tenant="acme", session="s1", model="m1", pod="p2",
        status=503, outcome="upstream_error", prompt_tokens=10, borrowed_requests=1,
        borrowed_tokens=40),  # drawn at admission, then refunded: no borrowed use
    rec(3, ts=BASE + timedelta(seconds=2), tenant="acme", session="s1", model="m2", pod="p1",
        status=0, outcome="aborted", prompt_tokens=10, completion_tokens=5, charged_tokens=15,
        queue_ms=800.0, ttft_ms=300.0),
    rec(4, ts=BASE + timedelta(seconds=4), tenant="beta", session="s2", model="m1", pod="p1",
        prompt_tokens=7, completion_tokens=8, charged_tokens=15, ttft_ms=200.0,
        cost_micros=500000, currency="USD"),
    rec(5, ts=BASE + timedelta(seconds=5), tenant="beta", model="m2", status=429,
        outcome="refused"),
    rec(6, ts=NOW - timedelta(days=3), tenant="acme", session="s3", model="m1", pod="p2",
        prompt_tokens=100, completion_tokens=100, charged_tokens=200, ttft_ms=500.0),
]  # fmt: skip


@pytest.fixture
async def ledger_db(db: str, make_ledger: Callable[..., Ledger]) -> str:
    ledger = make_ledger(db)
    await ledger.start()
    ledger.submit(DATASET)
    await eventually_async(
        lambda: metric(ledger, "llmgw_ledger_written_total", table="outcomes") == 6, 30.0
    )
    return db


async def run(url: str, *flags: str) -> str:
    return await usage.render(
        url, cli.parser().parse_args(["usage", "--database-url", url, *flags])
    )


def parse(text: str) -> dict[str, dict[str, str]]:
    """Table rows by their first cell; every line must be as wide as the header."""
    lines = text.rstrip("\n").splitlines()
    assert len({len(line) for line in lines}) == 1, f"not aligned:\n{text}"
    header = [h.lower() for h in lines[0].split()]
    return {cells[0]: dict(zip(header, cells, strict=True)) for cells in map(str.split, lines[1:])}


async def test_totals_by_tenant(ledger_db: str) -> None:
    rows = parse(await run(ledger_db))
    assert rows["acme"] == {
        "tenant": "acme", "requests": "4", "errors": "1", "refused": "0", "aborted": "1",
        "prompt_tokens": "130", "completion_tokens": "125", "charged_tokens": "245",
        "base_tokens": "233", "borrowed_tokens": "12", "borrowed_requests": "2",
        # req-1's cost split as its charge: 12 of its 30 tokens borrowed (micro-units, down).
        "cost": "0.001234", "base_cost": "0.000741", "borrowed_cost": "0.000493",
        "currency": "USD", "gpu_seconds": "0.052",
        "queue_p50_ms": "400.0", "queue_p90_ms": "720.0",  # two held; the others not
        "ttft_p50_ms": "300.0", "ttft_p90_ms": "460.0",
    }  # fmt: skip
    assert (rows["beta"]["queue_p50_ms"], rows["beta"]["queue_p90_ms"]) == ("-", "-")
    assert rows["beta"]["refused"] == "1" and rows["beta"]["ttft_p50_ms"] == "200.0"


async def test_since_keeps_recent_requests(ledger_db: str) -> None:
    acme = parse(await run(ledger_db, "--since", "1d"))["acme"]
    assert (acme["requests"], acme["prompt_tokens"], acme["charged_tokens"]) == ("3", "30", "45")
    assert (acme["ttft_p50_ms"], acme["ttft_p90_ms"]) == ("200.0", "280.0")
    two_hours_ago = (NOW - timedelta(hours=2)).isoformat()
    assert list(parse(await run(ledger_db, "--since", two_hours_ago, "--tenant", "beta"))) == [
        "beta"
    ]


@pytest.mark.parametrize(
    ("by", "expected"),
    [
        ("tenant", {"acme": "3", "beta": "2"}),
        ("session", {"s1": "3", "s2": "1", "-": "1"}),
        ("model", {"m1": "3", "m2": "2"}),
        ("pod", {"p1": "3", "p2": "1", "-": "1"}),
    ],
)
async def test_totals_by_each_key(ledger_db: str, by: str, expected: dict[str, str]) -> None:
    rows = parse(await run(ledger_db, "--by", by, "--since", "1d"))
    assert {key: row["requests"] for key, row in rows.items()} == expected
    assert next(iter(rows.values()))[by] in expected


async def test_a_session_in_time_order(ledger_db: str) -> None:
    lines = (await run(ledger_db, "--session", "s1")).splitlines()
    assert lines[0].split()[:2] == ["TS", "REQUEST_ID"]
    assert [line.split()[1] for line in lines[1:]] == ["req-2", "req-3", "req-1"]
    assert [line.split()[5] for line in lines[1:]] == ["upstream_error", "aborted", "ok"]
    queue = lines[0].split().index("QUEUE_MS")
    assert [line.split()[queue] for line in lines[1:]] == ["-", "800.0", "0.0"]


async def test_json_records_keep_the_field_order(ledger_db: str) -> None:
    lines = (await run(ledger_db, "--json", "--tenant", "acme")).splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["request_id"] for r in records] == ["req-6", "req-2", "req-3", "req-1"]
    for r in records:
        assert tuple(r)[: len(JSON_FIELDS)] == JSON_FIELDS
    first = records[-1]
    assert datetime.fromisoformat(first["ts"]) == BASE + timedelta(seconds=3)
    assert (first["ttft_ms"], first["charged_tokens"], first["stream"]) == (100.0, 30, False)
    assert (first["queue_ms"], records[1]["queue_ms"]) == (0.0, None)
    assert (first["borrowed_requests"], first["borrowed_tokens"]) == (1, 12)  # the record's draw
    assert (first["cost"], first["currency"], first["cost_micros"]) == (0.001234, "USD", 1234)
    assert (records[1]["cost"], records[1]["currency"]) == (0, "")  # unpriced
    assert (first["gpu_seconds"], records[1]["gpu_seconds"]) == (0.052, None)
    assert records[1]["ttft_ms"] is None


async def test_json_totals_with_by(ledger_db: str) -> None:
    lines = (await run(ledger_db, "--json", "--by", "model", "--since", "1d")).splitlines()
    totals = {r["model"]: r for r in map(json.loads, lines)}
    assert totals["m1"]["requests"] == 3 and totals["m2"]["charged_tokens"] == 15
    m1 = totals["m1"]
    assert (m1["base_tokens"], m1["borrowed_tokens"], m1["borrowed_requests"]) == (33, 12, 2)
    assert (m1["cost"], m1["base_cost"], m1["borrowed_cost"]) == (0.501234, 0.500741, 0.000493)
    assert m1["cost_micros"] == 501234  # the exact sum beside the amounts


async def test_the_cli_command_reads_the_url_from_the_environment(ledger_db: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "llmgw", "usage", "--json", "--session", "s2",
        env={**os.environ, "LLMGW_DATABASE_URL": ledger_db},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert [json.loads(line)["request_id"] for line in out.decode().splitlines()] == ["req-4"]


async def test_an_unreachable_database_is_a_clear_error(tmp_path: Path) -> None:
    url = "postgresql://llmgw:secret-pw@127.0.0.1:1/llmgw"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "llmgw", "usage", "--database-url", url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2
    assert b"usage: database" in err and b"secret-pw" not in err


def test_default_database_url(
    tmp_path: Path, shared_pg: Postgres, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LLMGW_DATABASE_URL", raising=False)
    assert usage.default_database_url(tmp_path) is None
    assert usage.default_database_url(shared_pg.home.parent) == shared_pg.url  # running server
    runs = {"run-20261201-100000": "postgresql://new", "run-20261201-090000": "postgresql://old"}
    for run_dir, url in runs.items():
        (tmp_path / run_dir).mkdir()
        (tmp_path / run_dir / "ready.json").write_text(json.dumps({"database_url": url}))
    assert usage.default_database_url(tmp_path) == "postgresql://new"
    monkeypatch.setenv("LLMGW_DATABASE_URL", "postgresql://env")
    assert usage.default_database_url(tmp_path) == "postgresql://env"
