"""Ledger write throughput: records/s into a real PostgreSQL (tools.postgres) by batch size.

    .venv/bin/python -m bench.ledger_write [--records 50000] [--batches 100,1000,5000]

Each row: a fresh `outcomes` table, all records submitted at once (the backlog is the queue),
timed until the writer has written the last one. Also: a steady 500 records/s for a few seconds
(issue 8's load target), with the backlog it keeps and the batch sizes it forms by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
from prometheus_client import CollectorRegistry

from ledger.db import Ledger, LedgerMetrics
from llmgw.outcome import Outcome
from tools.postgres import Postgres


def records(n: int, offset: int = 0) -> list[Outcome]:
    rng = random.Random(offset)
    t0 = datetime.now(UTC)
    return [
        Outcome(
            request_id=f"bench-{offset + i:09d}",
            ts=t0 + timedelta(microseconds=i),
            tenant=f"tenant-{rng.randrange(20)}",
            tier="standard",
            session=f"sess_{rng.randrange(10**9):x}",
            model="llama-3-8b",
            endpoint="/v1/chat/completions",
            pod=f"127.0.0.1:{9000 + rng.randrange(8)}",
            status=200,
            attempts=1,
            stream=True,
            outcome="ok",
            prompt_tokens=rng.randrange(2000),
            completion_tokens=rng.randrange(1000),
            reserved_tokens=3000,
            charged_tokens=rng.randrange(3000),
            ttft_ms=rng.uniform(20, 400),
            duration_ms=rng.uniform(100, 20000),
            bytes_in=rng.randrange(10**5),
            bytes_out=rng.randrange(10**5),
        )
        for i in range(n)
    ]


def value(ledger: Ledger, name: str, **labels: str) -> float:
    return ledger.metrics.registry.get_sample_value(name, labels) or 0.0


async def fresh(url: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("DROP TABLE IF EXISTS outcomes, ledger_events, schema_migrations")
    finally:
        await conn.close()


async def wait_written(ledger: Ledger, n: int, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while value(ledger, "llmgw_ledger_written_total", table="outcomes") < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"not written within {timeout_s}s")
        await asyncio.sleep(0.005)


async def burst(url: str, n: int, batch_max: int) -> tuple[float, float, float]:
    await fresh(url)
    ledger = Ledger(url, batch_max=batch_max, metrics=LedgerMetrics(CollectorRegistry()))
    await ledger.start()
    batch = records(n)
    start = time.perf_counter()
    ledger.submit(batch)
    await wait_written(ledger, n)
    elapsed = time.perf_counter() - start
    batches = value(ledger, "llmgw_ledger_batch_records_count")
    write_s = value(ledger, "llmgw_ledger_write_seconds_sum")
    await ledger.close()
    return n / elapsed, n / batches, 1000 * write_s / batches


async def steady(url: str, rate: int, seconds: float) -> tuple[int, float, int, float]:
    await fresh(url)
    ledger = Ledger(url, metrics=LedgerMetrics(CollectorRegistry()))
    await ledger.start()
    tick, sent, peak = 0.01, 0, 0
    start = time.perf_counter()
    while (now := time.perf_counter() - start) < seconds:
        due = int(now * rate)
        ledger.submit(records(due - sent, offset=sent))
        sent = due
        peak = max(peak, ledger.backlog)
        await asyncio.sleep(tick)
    await wait_written(ledger, sent)
    batches = value(ledger, "llmgw_ledger_batch_records_count")
    await ledger.close()
    return sent, sent / batches, peak, value(ledger, "llmgw_ledger_dropped_total")


async def main() -> None:
    args = argparse.ArgumentParser(description=__doc__)
    args.add_argument("--records", type=int, default=50_000)
    args.add_argument("--batches", default="100,1000,5000")
    args.add_argument("--steady-seconds", type=float, default=5.0)
    opts = args.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        pg = Postgres(Path(tmp) / "postgres")
        pg.start(120)
        try:
            print(f"{'batch_max':>9}  {'records':>8}  {'records/s':>10}  {'mean batch':>10}  "
                  f"{'ms/batch':>8}")  # fmt: skip
            for batch_max in map(int, opts.batches.split(",")):
                rate, mean, ms = await burst(pg.url, opts.records, batch_max)
                print(
                    f"{batch_max:>9}  {opts.records:>8}  {rate:>10.0f}  {mean:>10.0f}  {ms:>8.1f}"
                )
            sent, mean, peak, dropped = await steady(pg.url, 500, opts.steady_seconds)
            print(f"\nsteady 500/s for {opts.steady_seconds:.0f}s: {sent} records, mean batch "
                  f"{mean:.1f}, peak backlog {peak}, dropped {dropped:.0f}")  # fmt: skip
        finally:
            pg.stop()


if __name__ == "__main__":
    asyncio.run(main())
