"""Does one tenant's large bodies slow authorization for everyone else?

One stack (real Envoy, every service, simulated pods). A small-request tenant sends chat requests
at a fixed rate; meanwhile another tenant sends bodies of `--mib` MiB (read by extauthz's body
pool, extauthz/body.py, off the event loop), `--heavy` at a time. The table compares the small
tenant's latency without and with the heavy load, in alternating rounds, and counts failures
(a 503 would mean extauthz missed Envoy's deadline).

    python -m bench.large_bodies [--rounds 3] [--seconds 4] [--mib 3.9] [--heavy 8] [--rate 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

from tools.envoyconf import Address
from tools.stack import Stack, StackSettings

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SMALL = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def key(stack: Stack, tier: str) -> str:
    return next(t["api_key"] for t in stack.tenants if t["tier"] == tier)


async def small_load(
    stack: Stack, api_key: str, seconds: float, rate: float
) -> tuple[list[float], int]:
    """Open-loop small requests at `rate`/s: their latencies and how many failed."""
    latencies: list[float] = []
    failed = 0
    headers = {"authorization": f"Bearer {api_key}"}
    async with aiohttp.ClientSession(headers=headers) as session:

        async def one() -> None:
            nonlocal failed
            start = time.perf_counter()
            async with session.post(f"{stack.base_url}/chat/completions", json=SMALL) as r:
                await r.read()
                if r.status != 200:
                    failed += 1
                    return
            latencies.append(time.perf_counter() - start)

        tasks = []
        started = time.perf_counter()
        for i in range(int(seconds * rate)):
            await asyncio.sleep(max(0.0, i / rate - (time.perf_counter() - started)))
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
    return latencies, failed


async def heavy_load(stack: Stack, api_key: str, body: bytes, stop: asyncio.Event, n: int) -> int:
    """`n` senders of the large body until `stop`: how many were sent."""
    sent = 0
    headers = {"authorization": f"Bearer {api_key}", "content-type": "application/json"}
    async with aiohttp.ClientSession(headers=headers) as session:

        async def sender() -> None:
            nonlocal sent
            while not stop.is_set():
                async with session.post(f"{stack.base_url}/chat/completions", data=body) as r:
                    await r.read()
                sent += 1

        await asyncio.gather(*(sender() for _ in range(n)))
    return sent


async def round_(
    stack: Stack, args: argparse.Namespace, body: bytes, heavy: bool
) -> dict[str, float]:
    stop = asyncio.Event()
    senders = (
        asyncio.create_task(heavy_load(stack, key(stack, "free"), body, stop, args.heavy))
        if heavy
        else None
    )
    if heavy:
        await asyncio.sleep(0.5)  # the heavy load is running before the measurement starts
    latencies, failed = await small_load(stack, key(stack, "platinum"), args.seconds, args.rate)
    stop.set()
    sent = await senders if senders is not None else 0
    arr = np.array(latencies) * 1000
    return {
        "p50": float(np.percentile(arr, 50)),
        "p99": float(np.percentile(arr, 99)),
        "failed": failed,
        "heavy sent": sent,
    }


async def run(args: argparse.Namespace) -> None:
    text = "x" * int(args.mib * 1024 * 1024)
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}]}).encode()
    with tempfile.TemporaryDirectory() as state:
        settings = StackSettings(listen=Address(port=0), pods=2, sim_args=("--time-scale", "0.05"))
        with Stack(settings, Path(state)) as stack:
            rows: dict[bool, list[dict[str, float]]] = {False: [], True: []}
            for _ in range(args.rounds):
                for heavy in (False, True):
                    rows[heavy].append(await round_(stack, args, body, heavy))
    print(
        f"Small requests of one tenant at {args.rate}/s while another sends {args.mib} MiB bodies, "
        f"{args.heavy} at a time ({args.rounds} alternating rounds of {args.seconds} s)\n"
    )
    print("| small tenant | p50 ms | p99 ms | failed | large bodies sent |")
    print("|---|---|---|---|---|")
    for heavy, label in ((False, "alone"), (True, "beside large bodies")):
        rs = rows[heavy]
        print(
            f"| {label} | {np.median([r['p50'] for r in rs]):.1f} "
            f"| {np.median([r['p99'] for r in rs]):.1f} | {sum(r['failed'] for r in rs):.0f} "
            f"| {sum(r['heavy sent'] for r in rs):.0f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--mib", type=float, default=3.9)
    parser.add_argument("--heavy", type=int, default=8)
    parser.add_argument("--rate", type=float, default=20.0)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
