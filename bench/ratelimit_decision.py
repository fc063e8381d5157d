"""Rate-limit decisions with a real redis-server: throughput, latency, accuracy.

    .venv/bin/python bench/ratelimit_decision.py [--seconds 3]

Prints: decisions/s (one process, one core of the event loop), p50/p99 of one decision inside the
service (Limiter.admit: policy, one EVALSHA over the RESP client, folding, metrics), the client
cost of one EVALSHA via llmgw.resp vs redis.asyncio, and admitted − limit under concurrency
(4 engines sharing Redis, 400 concurrent requests against a limit of 100; must be 0).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from dataclasses import replace
from decimal import Decimal
from pathlib import Path

import redis.asyncio as redis_asyncio
import uvloop

from llmgw.prices import ModelPrice, Prices
from llmgw.tiers import PerUnit, Spend, TierSpec, TierTable
from llmgw.wire import breaker_key, tenant_prefix
from ratelimit.failover import Failover
from ratelimit.fleet import IDLE_UNKNOWN
from ratelimit.limiter import Limiter
from ratelimit.limits import Limits
from ratelimit.redis_store import ADMIT
from ratelimit.types import Admission, Grant
from tools.procs import Process, bin_path, free_port, redis_ping

CONFIG = TierTable(
    tiers={
        "big": TierSpec(
            requests=PerUnit(second=10**9, minute=10**9), tokens=PerUnit(minute=10**12)
        ),
        "small": TierSpec(requests=PerUnit(minute=100)),
        # big's limits and a money budget per day and per month (never exhausted here).
        "spender": TierSpec(
            requests=PerUnit(second=10**9, minute=10**9),
            tokens=PerUnit(minute=10**12),
            spend=Spend(day=Decimal(10**7), month=Decimal(10**8)),
        ),
    },
    prices=Prices(models={"m": ModelPrice(input=Decimal("0.1"), output=Decimal("0.4"))}),
)


async def engine(port: int) -> Limiter:
    store = Failover("127.0.0.1", port, deadline_s=1.0)
    await store.start()
    return Limiter(Limits(CONFIG).policy, store, lambda: IDLE_UNKNOWN, time.time)


def pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


async def run(port: int, seconds: float) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    limiter = await engine(port)
    req = Admission("bench", "big", request_id="r", token_estimate=500)
    # Sequential: the decision time inside the service.
    times: list[float] = []
    cpu0 = time.process_time()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        await limiter.admit(req)
        times.append(time.perf_counter() - t0)
    cpu = (time.process_time() - cpu0) / len(times)
    rows += [
        ("decision p50 (sequential)", f"{pct(times, 0.5) * 1e3:.3f} ms"),
        ("decision p99 (sequential)", f"{pct(times, 0.99) * 1e3:.3f} ms"),
        ("client CPU per decision", f"{cpu * 1e6:.0f} µs"),
        ("decisions/s (sequential)", f"{len(times) / seconds:,.0f}"),
    ]
    # Concurrent: 64 in flight, pipelined over one connection.
    done = 0
    end = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < end:
            await limiter.admit(req)
            done += 1

    await asyncio.gather(*(worker() for _ in range(64)))
    rows.append(("decisions/s (64 concurrent)", f"{done / seconds:,.0f}"))
    rows += await breaker_cost(limiter, seconds)
    rows += await money_cost(limiter, seconds)
    # The Redis client path alone: one EVALSHA, llmgw.resp vs redis.asyncio.
    assert limiter.store.redis is not None  # type: ignore[attr-defined]
    client = limiter.store.redis.client  # type: ignore[attr-defined]
    ra = redis_asyncio.Redis(port=port)
    args = [0, "", 0, 0]  # admit.lua with no checks: shadow, reservation, ttl, count
    calls = {
        "resp": lambda: client.call("EVALSHA", ADMIT[1], 1, "k", *args),
        "redis.asyncio": lambda: ra.evalsha(ADMIT[1], 1, "k", *args),
    }
    for name, call in calls.items():
        lat = []
        cpu0 = time.process_time()
        for _ in range(3000):
            t0 = time.perf_counter()
            await call()
            lat.append(time.perf_counter() - t0)
        cpu = (time.process_time() - cpu0) / 3000
        value = f"{pct(lat, 0.5) * 1e6:.0f} µs / {cpu * 1e6:.0f} µs"
        rows.append((f"EVALSHA via {name}: p50 / CPU", value))
    await ra.aclose()
    # Accuracy under concurrency.
    worst = 0
    for trial in range(5):
        engines = [await engine(port) for _ in range(4)]
        verdicts = await asyncio.gather(
            *(engines[i % 4].admit(Admission(f"acc{trial}", "small")) for i in range(400))
        )
        worst = max(worst, abs(sum(v.allowed for v in verdicts) - 100))
        for e in engines:
            await e.store.close()  # type: ignore[attr-defined]
    rows.append(("admitted − limit (5 × 400 vs 100, 4 engines)", str(worst)))
    await limiter.store.close()  # type: ignore[attr-defined]
    return rows


async def breaker_cost(limiter: Limiter, seconds: float) -> list[tuple[str, str]]:
    """The store call of one decision (the same checks), without the breaker key, with it
    (closed: one HMGET of a missing key inside admit.lua), and with it open (the refusal). Rounds
    alternate, so a noisy neighbour on the box hits each alike."""
    store = limiter.store
    checks = Limiter.checks(Limits(CONFIG).policy("bench", "big"), 500)
    prefix = tenant_prefix("bench")
    open_key = breaker_key("bench-open")
    client = store.redis.client  # type: ignore[attr-defined]
    await client.call("HSET", open_key, "o", 2**50, "sm", 1000, "p", "100 300 1000")
    ways = {"without breaker": "", "breaker closed": breaker_key("bench"), "breaker open": open_key}
    times: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(10):
        for way, key in ways.items():
            end = time.perf_counter() + seconds / 10
            while time.perf_counter() < end:
                t0 = time.perf_counter()
                await store.admit(prefix, checks, 0, reservation="r", ttl_ms=60_000, breaker=key)
                times[way].append(time.perf_counter() - t0)
    return [
        (f"admit.lua {way}: p50 / p99", f"{pct(t, 0.5) * 1e6:.0f} µs / {pct(t, 0.99) * 1e6:.0f} µs")
        for way, t in times.items()
    ]


async def money_cost(limiter: Limiter, seconds: float) -> list[tuple[str, str]]:
    """One decision without a money budget and with two (day and month): the client's CPU and
    its Redis round trips per decision, in alternating rounds."""
    plain = Admission("bench", "big", request_id="r", token_estimate=500, grant=Grant(100, 1))
    priced = replace(plain, tier="spender", model="m", prompt_ceiling=120)
    client = limiter.store.redis.client  # type: ignore[attr-defined]
    sent = 0
    call = client.call

    def counted(*args: object) -> object:
        nonlocal sent
        sent += 1
        return call(*args)

    client.call = counted
    cpu = {"without": 0.0, "with": 0.0}
    count = {"without": 0, "with": 0}
    trips = {"without": 0, "with": 0}
    try:
        for _ in range(10):
            for way, req in (("without", plain), ("with", priced)):
                before = sent
                cpu0 = time.process_time()
                end = time.perf_counter() + seconds / 10
                while time.perf_counter() < end:
                    assert (await limiter.admit(req)).allowed
                    count[way] += 1
                cpu[way] += time.process_time() - cpu0
                trips[way] += sent - before
    finally:
        client.call = call
    per = {way: cpu[way] / count[way] for way in cpu}
    calls = {way: trips[way] / count[way] for way in cpu}
    return [
        ("CPU per decision, money budgets ÷ none", f"{per['with'] / per['without']:.2f}×"),
        (
            "Redis round trips per decision: none / money budgets",
            f"{calls['without']:.2f} / {calls['with']:.2f}",
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        argv = [bin_path("redis-server"), "--port", str(port), "--save", "", "--dir", tmp]
        proc = Process("redis", argv, redis_ping("127.0.0.1", port), Path(tmp) / "redis.log")
        proc.start()
        try:
            rows = uvloop.run(run(port, args.seconds))
        finally:
            proc.stop()
    width = max(len(k) for k, _ in rows)
    print(f"{'measure':<{width}}  value")
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


if __name__ == "__main__":
    main()
