"""What the gateway adds over talking to a pod directly.

One pod behind the full local stack. Rounds alternate direct-to-pod and through-Envoy batches at
the same fixed concurrency, so both see the same machine load; the table gives p50/p99 of
non-stream latency and of stream TTFT, the difference, and the ratio.

    python -m bench.overhead [--requests 400] [--concurrency 8] [--time-scale 0.1]
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

from llmgw.envoyconf import Address
from llmgw.stack import Stack, StackSettings

PROMPT = [{"role": "user", "content": "Summarise the plot of a short story in one line."}]


async def one(session: aiohttp.ClientSession, url: str, model: str, stream: bool) -> float:
    body = {"model": model, "messages": PROMPT, "max_tokens": 8, "stream": stream}
    start = time.perf_counter()
    async with session.post(f"{url}/chat/completions", json=body) as resp:
        resp.raise_for_status()
        if not stream:
            await resp.read()
            return time.perf_counter() - start
        async for line in resp.content:
            if line.startswith(b"data: ") and b'"content"' in line:
                ttft = time.perf_counter() - start
                await resp.read()
                return ttft
    raise RuntimeError("stream ended without content")


async def batch(url: str, model: str, stream: bool, n: int, concurrency: int) -> list[float]:
    gate = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def run() -> float:
            async with gate:
                return await one(session, url, model, stream)

        return list(await asyncio.gather(*(run() for _ in range(n))))


async def measure(direct: str, gateway: str, args: argparse.Namespace) -> dict[str, list[float]]:
    async with aiohttp.ClientSession() as session, session.get(f"{direct}/models") as resp:
        model = json.loads(await resp.read())["data"][0]["id"]
    samples: dict[str, list[float]] = {}
    per_round = max(1, args.requests // args.rounds)
    for stream in (False, True):
        await batch(gateway, model, stream, args.concurrency * 4, args.concurrency)  # warm up
        for r in range(args.rounds):
            order = [("direct", direct), ("gateway", gateway)]
            for name, url in order if r % 2 == 0 else order[::-1]:
                key = f"{'ttft' if stream else 'latency'}/{name}"
                lat = await batch(url, model, stream, per_round, args.concurrency)
                samples.setdefault(key, []).extend(lat)
    return samples


def table(samples: dict[str, list[float]], args: argparse.Namespace) -> str:
    rows = [
        f"gateway overhead: {args.requests} requests per cell, concurrency {args.concurrency}, "
        f"one pod at time-scale {args.time_scale}",
        f"{'metric':<22}{'direct ms':>11}{'gateway ms':>12}{'added ms':>10}{'ratio':>8}",
    ]
    for metric in ("latency", "ttft"):
        for q in (50, 99):
            d = float(np.percentile(samples[f"{metric}/direct"], q)) * 1e3
            g = float(np.percentile(samples[f"{metric}/gateway"], q)) * 1e3
            label = f"{'non-stream latency' if metric == 'latency' else 'stream TTFT'} p{q}"
            rows.append(f"{label:<22}{d:>11.2f}{g:>12.2f}{g - d:>10.2f}{g / d:>8.2f}")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--time-scale", type=float, default=0.1)
    args = parser.parse_args()
    settings = StackSettings(
        listen=Address(port=0), pods=1, sim_args=("--time-scale", str(args.time_scale))
    )
    with tempfile.TemporaryDirectory() as tmp, Stack(settings, Path(tmp)) as stack:
        samples = asyncio.run(measure(stack.pod_url(0) + "/v1", stack.base_url, args))
    print(table(samples, args))


if __name__ == "__main__":
    main()
