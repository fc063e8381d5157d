"""What a valid tenant sees while strangers attack the gateway's shared resources.

One stack (real Envoy, every service, simulated pods). A valid tenant sends ordinary chat
requests at a fixed rate; in alternating rounds, meanwhile, strangers (keys of our shape that
are nobody's), from a process of their own, keep `--stalled` uploads of 8 MB minus a byte open,
each stalled after 1 KiB and re-opened a second after the gateway answers it, and `--bodies`
senders post whole 8 MB bodies back to back. The table compares the tenant's success rate and
latency with and without the attack, and each process's peak memory.

    python -m bench.hostile [--rounds 3] [--seconds 5] [--rate 20] [--stalled 300] [--bodies 50]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import multiprocessing
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from bench.large_bodies import SMALL, key, small_load
from tools.envoyconf import Address
from tools.stack import Stack, StackSettings

MB = 1024 * 1024
STRANGER = f"sk-llmgw-{'z' * 43}"


def rss_mib(pid: int | None) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def stalled_uploads(host: str, port: int, n: int, stop: asyncio.Event) -> int:
    """`n` stalled stranger uploads until `stop`, each re-opened a second after the gateway
    answers it (an attacker keeping 300 open): how many the gateway answered."""
    head = (
        (
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {8 * MB - 1}\r\nauthorization: Bearer {STRANGER}\r\n\r\n"
        ).encode()
        + b'{"model": "'
        + b"m" * 1024
    )
    answered = 0

    async def one() -> None:
        nonlocal answered
        while not stop.is_set():
            reader, writer = await asyncio.open_connection(host, port)
            try:
                writer.write(head)
                read = asyncio.ensure_future(reader.read(65536))
                done, _ = await asyncio.wait((read,), timeout=1.0)
                if not done:  # held by the gateway: hold it until the round ends
                    await stop.wait()
                    read.cancel()
                elif read.result():
                    answered += 1
            finally:
                writer.close()
            await asyncio.sleep(1.0)

    await asyncio.gather(*(one() for _ in range(n)))
    return answered


async def stranger_bodies(base_url: str, n: int, stop: asyncio.Event) -> int:
    """`n` senders of 8 MB stranger bodies, back to back, until `stop`: how many were sent."""
    body = json.dumps({"model": SMALL["model"], "x": "a" * (8 * MB - 1024)}).encode()
    headers = {"authorization": f"Bearer {STRANGER}", "content-type": "application/json"}
    sent = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def sender() -> None:
            nonlocal sent
            while not stop.is_set():
                try:
                    async with session.post(
                        f"{base_url}/chat/completions", data=io.BytesIO(body), headers=headers
                    ) as r:
                        await r.read()
                except aiohttp.ClientError:
                    pass  # refused before the body was read: the send broke
                sent += 1

        await asyncio.gather(*(sender() for _ in range(n)))
    return sent


def attack(stack_address: tuple[str, int], args: argparse.Namespace, stop: Any, out: Any) -> None:
    """The strangers, in a process of their own: the tenant's client is not theirs to slow."""

    async def main() -> None:
        done = asyncio.Event()
        host, port = stack_address
        tasks = [
            asyncio.create_task(stalled_uploads(host, port, args.stalled, done)),
            asyncio.create_task(stranger_bodies(f"http://{host}:{port}/v1", args.bodies, done)),
        ]
        await asyncio.to_thread(stop.wait)
        done.set()
        out[0], out[1] = await asyncio.gather(*tasks)

    asyncio.run(main())


async def round_(stack: Stack, args: argparse.Namespace, attacked: bool) -> dict[str, float]:
    context = multiprocessing.get_context("spawn")
    stop, out = context.Event(), context.Array("d", 2)
    attacker = None
    if attacked:
        address = (stack.listen.host, stack.listen.port)
        attacker = context.Process(target=attack, args=(address, args, stop, out))
        attacker.start()
        await asyncio.sleep(2.0)  # the attack is running before the measurement starts
    peaks = {name: 0.0 for name in ("envoy", "extauthz")}
    sampling = True

    async def sample() -> None:
        while sampling:
            for name in peaks:
                pid = next(p for p in stack.processes if p.name == name).pid
                peaks[name] = max(peaks[name], rss_mib(pid))
            await asyncio.sleep(0.2)

    sampler = asyncio.create_task(sample())
    latencies, failed = await small_load(stack, key(stack, "platinum"), args.seconds, args.rate)
    sampling = False
    await sampler
    if attacker is not None:
        stop.set()
        await asyncio.to_thread(attacker.join, 60)
    arr = np.array(latencies) * 1000
    total = len(latencies) + failed
    return {
        "ok": len(latencies) / total if total else 0.0,
        "p50": float(np.percentile(arr, 50)) if len(arr) else float("nan"),
        "p99": float(np.percentile(arr, 99)) if len(arr) else float("nan"),
        "answered": out[0],
        "bodies": out[1],
        **{f"{name} MiB": peak for name, peak in peaks.items()},
    }


async def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as state:
        settings = StackSettings(listen=Address(port=0), pods=2, sim_args=("--time-scale", "0.05"))
        with Stack(settings, Path(state)) as stack:
            rows: dict[bool, list[dict[str, float]]] = {False: [], True: []}
            started = time.perf_counter()
            for _ in range(args.rounds):
                for attacked in (False, True):
                    rows[attacked].append(await round_(stack, args, attacked))
    print(
        f"A valid tenant's chat requests at {args.rate}/s, alone and while strangers keep "
        f"{args.stalled} stalled 8 MB uploads open and {args.bodies} senders post 8 MB bodies "
        f"({args.rounds} alternating rounds of {args.seconds} s, "
        f"{time.perf_counter() - started:.0f} s)\n"
    )
    print(
        "| valid tenant | success | p50 ms | p99 ms | p50 ratio | stalled answered "
        "| 8 MB bodies sent | Envoy peak MiB | extauthz peak MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    alone = float(np.median([r["p50"] for r in rows[False]]))
    for attacked, label in ((False, "alone"), (True, "under attack")):
        rs = rows[attacked]
        p50 = float(np.median([r["p50"] for r in rs]))
        print(
            f"| {label} | {min(r['ok'] for r in rs):.1%} | {p50:.1f} "
            f"| {np.median([r['p99'] for r in rs]):.1f} | {p50 / alone:.2f} "
            f"| {sum(r['answered'] for r in rs):.0f} | {sum(r['bodies'] for r in rs):.0f} "
            f"| {max(r['envoy MiB'] for r in rs):.0f} | {max(r['extauthz MiB'] for r in rs):.0f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--stalled", type=int, default=300)
    parser.add_argument("--bodies", type=int, default=50)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
