"""What the gateway adds over talking to a pod directly, and what each service adds.

One simulated pod; in front of it, side by side, one stack per configuration: Envoy alone,
+ extauthz, + ratelimit, + router (the full chain). Rounds rotate through direct-to-pod and every
stack at the same fixed concurrency, so all see the same machine load. The table gives p50/p99 of
non-stream latency and of stream TTFT, what each adds over direct, and the ratio.

    python -m bench.overhead [--requests 400] [--concurrency 8] [--time-scale 0.1]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

from tools.envoyconf import Address
from tools.stack import ServiceName, Stack, StackSettings

PROMPT = [{"role": "user", "content": "Summarise the plot of a short story in one line."}]
CONFIGS: dict[str, tuple[ServiceName, ...]] = {
    "envoy": (),
    "+extauthz": ("extauthz",),
    "+ratelimit": ("extauthz", "ratelimit"),
    "+router": ("extauthz", "ratelimit", "router"),
}


async def one(session: aiohttp.ClientSession, url: str, body: dict[str, object]) -> float:
    start = time.perf_counter()
    async with session.post(f"{url}/chat/completions", json=body) as resp:
        resp.raise_for_status()
        if not body["stream"]:
            await resp.read()
            return time.perf_counter() - start
        async for line in resp.content:
            if line.startswith(b"data: ") and b'"content"' in line:
                ttft = time.perf_counter() - start
                await resp.read()
                return ttft
    raise RuntimeError("stream ended without content")


async def batch(
    url: str, key: str, body: dict[str, object], n: int, concurrency: int
) -> list[float]:
    gate = asyncio.Semaphore(concurrency)
    headers = {"authorization": f"Bearer {key}"}
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:

        async def run() -> float:
            async with gate:
                return await one(session, url, body)

        return list(await asyncio.gather(*(run() for _ in range(n))))


async def measure(
    targets: dict[str, tuple[str, str]], args: argparse.Namespace
) -> dict[str, list[float]]:
    direct = targets["direct"][0]
    async with aiohttp.ClientSession() as session, session.get(f"{direct}/models") as resp:
        model = json.loads(await resp.read())["data"][0]["id"]
    samples: dict[str, list[float]] = {}
    per_round = max(1, args.requests // args.rounds)
    names = list(targets)
    for stream in (False, True):
        body = {"model": model, "messages": PROMPT, "max_tokens": 8, "stream": stream}
        for url, key in targets.values():  # warm up connections and caches
            await batch(url, key, body, args.concurrency * 2, args.concurrency)
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                url, key = targets[name]
                lat = await batch(url, key, body, per_round, args.concurrency)
                samples.setdefault(f"{'ttft' if stream else 'latency'}/{name}", []).extend(lat)
    return samples


def table(samples: dict[str, list[float]], names: list[str], args: argparse.Namespace) -> str:
    rows = [
        f"gateway overhead: {args.requests} requests per cell, concurrency {args.concurrency}, "
        f"one simulated pod at time-scale {args.time_scale}, max_tokens 8",
        f"{'metric':<24}{'path':<12}{'ms':>9}{'added ms':>10}{'ratio':>8}",
    ]
    for metric, label in (("latency", "non-stream latency"), ("ttft", "stream TTFT")):
        for q in (50, 99):
            base = float(np.percentile(samples[f"{metric}/direct"], q)) * 1e3
            for name in names:
                v = float(np.percentile(samples[f"{metric}/{name}"], q)) * 1e3
                rows.append(
                    f"{label + f' p{q}':<24}{name:<12}{v:>9.2f}{v - base:>10.2f}{v / base:>8.2f}"
                )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--time-scale", type=float, default=0.1)
    args = parser.parse_args()
    sim_args = ("--time-scale", str(args.time_scale))
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stacks:
        base = stacks.enter_context(
            Stack(
                StackSettings(listen=Address(port=0), pods=1, sim_args=sim_args, services=()),
                Path(tmp) / "envoy",
            )
        )
        pod, pod_key = base.pod_url(0), base.pod_api_key or ""
        targets = {"direct": (f"{pod}/v1", pod_key), "envoy": (base.base_url, "")}
        for name, services in list(CONFIGS.items())[1:]:
            settings = StackSettings.model_validate(
                {
                    "listen": Address(port=0),
                    "upstreams": (pod,),
                    "services": services,
                    "pod_api_key": pod_key,
                }
            )
            stack = stacks.enter_context(Stack(settings, Path(tmp) / name))
            targets[name] = (stack.base_url, stack.tenants[-1]["api_key"])  # platinum
        samples = asyncio.run(measure(targets, args))
    print(table(samples, list(targets)[1:], args))


if __name__ == "__main__":
    main()
