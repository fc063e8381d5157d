"""GPU time per request: the ledger's estimate (ledger/gputime.py) against the simulator's
exact accounting (each engine step shared evenly by its batch: GET /admin/gpu_seconds).

    python -m bench.gputime [--requests 48] [--time-scale 1.0]

One stack, two simulated pods at the profile's speed (requests of 0.1-2 s, against the
publisher's 1 s steps), streams whose outputs are 16-256 tokens, at concurrency 1, 4 and 16.
Per concurrency: each request's estimate over its exact time (p10, p50, p90) and the sum of the
estimates over the sum of the exact times (what a tenant's bill would show).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

from tools import cli, usage
from tools.envoyconf import Address
from tools.stack import Stack, StackSettings

CONCURRENCY = (1, 4, 16)


async def load(stack: Stack, key: str, n: int, concurrency: int, rng: random.Random) -> list[str]:
    """`n` streams at `concurrency`; their request IDs."""
    gate = asyncio.Semaphore(concurrency)
    headers = {"authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession(headers=headers) as session:

        async def one(i: int) -> str:
            body = {
                "model": stack.serving[0].model,
                "messages": [{"role": "user", "content": f"story {i} {rng.random()}"}],
                "max_tokens": rng.randint(16, 256),
                "ignore_eos": True,
                "stream": True,
            }
            async with gate, session.post(f"{stack.base_url}/chat/completions", json=body) as r:
                r.raise_for_status()
                await r.read()
                return r.headers["x-request-id"]

        return list(await asyncio.gather(*(one(i) for i in range(n))))


def recorded(stack: Stack, ids: set[str], timeout_s: float = 60.0) -> dict[str, float | None]:
    """The ledger's GPU-seconds of these requests, once it has them all (bounded)."""
    assert stack.database_url is not None
    argv = ["usage", "--json", "--database-url", stack.database_url]
    deadline = time.monotonic() + timeout_s
    while True:
        text = asyncio.run(usage.render(stack.database_url, cli.parser().parse_args(argv)))
        rows = {r["request_id"]: r for r in map(json.loads, text.splitlines())}
        if ids <= rows.keys() or time.monotonic() > deadline:
            return {i: rows[i]["gpu_seconds"] for i in ids if i in rows}
        time.sleep(0.5)


async def exact(stack: Stack) -> dict[str, float]:
    spent: dict[str, float] = {}
    async with aiohttp.ClientSession() as session:
        for i in range(len(stack.pods)):
            async with session.get(f"{stack.pod_url(i)}/admin/gpu_seconds") as r:
                spent.update(await r.json())
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--time-scale", type=float, default=1.0)
    args = parser.parse_args()
    rng = random.Random(7)
    settings = StackSettings(
        listen=Address(port=0), pods=2, sim_args=("--time-scale", str(args.time_scale))
    )
    with tempfile.TemporaryDirectory() as tmp, Stack(settings, Path(tmp) / "stack") as stack:
        key = next(t["api_key"] for t in stack.tenants if t["tier"] == "platinum")
        runs = {c: asyncio.run(load(stack, key, args.requests, c, rng)) for c in CONCURRENCY}
        estimates = recorded(stack, {i for ids in runs.values() for i in ids})
        truth = asyncio.run(exact(stack))
    print(f"{'concurrency':>11} {'requests':>8} {'p10':>6} {'p50':>6} {'p90':>6} {'sum ratio':>10}")
    for c, ids in runs.items():
        pairs = [(e, truth[i]) for i in ids if (e := estimates.get(i)) is not None and truth.get(i)]
        ratios = np.array([e / t for e, t in pairs])
        p10, p50, p90 = np.percentile(ratios, [10, 50, 90])
        total = sum(e for e, _ in pairs) / sum(t for _, t in pairs)
        print(f"{c:>11} {len(pairs):>8} {p10:>6.2f} {p50:>6.2f} {p90:>6.2f} {total:>10.2f}")


if __name__ == "__main__":
    main()
