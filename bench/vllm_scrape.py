"""Whether the router's scrape interval and timeout suit a real vLLM CPU pod's `/metrics`.

One real pod, started as the stack starts it (bench/vllm_pod.py), scraped as the router scrapes
(router/collectors/scraper.py: one aiohttp session with the pods' key, the next scrape
`scrape_interval` after the last one began, or at once if it took longer), but with a timeout
long enough to see every answer: idle, while one long stream runs, and while 4 run (each stream
`ignore_eos` to near the context, restarted as it ends). Then, for a few candidate timeouts, the
share of those scrapes that would have timed out and the longest the router would have gone
without a good one (past `stale_after`, 0.5 s, the pod is stale: not picked).

    python -m bench.vllm_scrape [--scrapes 300] [--interval 0.075]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

from bench.vllm_pod import Pod, settings

PROMPT = [{"role": "user", "content": "Tell a long story about a fox and a dog."}]
PHASES = {"idle": 0, "1 stream": 1, "4 streams": 4}
TIMEOUTS = (0.05, 0.1, 0.25, 0.5, 1.0)  # the router's 50 ms first
STALE_AFTER = 0.5  # router/fleet.py FleetSettings.stale_after


@dataclass
class Phase:
    starts: list[float] = field(default_factory=list)  # seconds since the phase began
    seconds: list[float] = field(default_factory=list)  # each scrape's latency
    tokens: int = 0  # content chunks the streams received meanwhile
    page: int = 0  # bytes of the last page
    elapsed: float = 0.0

    def ms(self, q: float) -> float:
        return float(np.percentile(self.seconds, q)) * 1e3

    def failed(self, timeout: float) -> float:
        return sum(s > timeout for s in self.seconds) / len(self.seconds)

    def longest_without(self, timeout: float) -> float:
        """The longest wait between good answers (and from the start, and to the end)."""
        last, longest = 0.0, 0.0
        for start, s in zip(self.starts, self.seconds, strict=True):
            if s <= timeout:
                longest = max(longest, start + s - last)
                last = start + s
        return max(longest, self.elapsed - last)


async def stream_forever(
    session: aiohttp.ClientSession, pod: Pod, phase: Phase, started: asyncio.Event
) -> None:
    """Long streams back to back; `started` once the first content arrives."""
    body = {
        "model": pod.model,
        "messages": PROMPT,
        "max_tokens": 900,
        "ignore_eos": True,
        "stream": True,
    }
    while True:
        async with session.post(f"{pod.url}/v1/chat/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.content:
                if line.startswith(b"data: ") and b'"content"' in line:
                    phase.tokens += 1
                    started.set()


async def scrape_phase(pod: Pod, streams: int, scrapes: int, interval: float) -> Phase:
    phase = Phase()
    headers = {"authorization": f"Bearer {pod.key}"}
    async with (
        aiohttp.ClientSession(headers=headers) as load,
        aiohttp.ClientSession(headers=headers) as scraper,
    ):
        events = [asyncio.Event() for _ in range(streams)]
        workers = [asyncio.create_task(stream_forever(load, pod, phase, e)) for e in events]
        for event in events:
            await event.wait()
        phase.tokens = 0
        begin = time.perf_counter()
        timeout = aiohttp.ClientTimeout(total=30)
        for _ in range(scrapes):
            start = time.perf_counter()
            async with scraper.get(f"{pod.url}/metrics", timeout=timeout) as resp:
                resp.raise_for_status()
                phase.page = len(await resp.read())
            took = time.perf_counter() - start
            phase.starts.append(start - begin)
            phase.seconds.append(took)
            await asyncio.sleep(max(0.0, interval - took))
        phase.elapsed = time.perf_counter() - begin
        for worker in workers:
            worker.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    return phase


def tables(phases: dict[str, Phase], args: argparse.Namespace) -> str:
    lines = [
        f"A real vLLM CPU pod's /metrics, scraped every {args.interval * 1e3:g} ms as the router "
        f"does, {args.scrapes} scrapes per phase; streams: max_tokens 900, ignore_eos, back to "
        "back, straight to the pod",
        "",
        "| pod load | p50 ms | p90 ms | p99 ms | max ms | page KiB | stream tokens/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, p in phases.items():
        lines.append(
            f"| {name} | {p.ms(50):.1f} | {p.ms(90):.1f} | {p.ms(99):.1f} | {p.ms(100):.1f} "
            f"| {p.page / 1024:.0f} | {p.tokens / p.elapsed:,.0f} |"
        )
    lines += [
        "",
        "Had the scrape timeout been T: the share of these scrapes that would have failed, and "
        f"the longest the router would have gone without a good one (stale past {STALE_AFTER} s)",
        "",
        "| timeout | " + " | ".join(phases) + " |",
        "|---|" + "---|" * len(phases),
    ]
    for t in TIMEOUTS:
        cells = [f"{p.failed(t):.1%} failed, {p.longest_without(t):.2f} s" for p in phases.values()]
        lines.append(f"| {t * 1e3:g} ms | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapes", type=int, default=300, help="per phase")
    parser.add_argument("--interval", type=float, default=0.075, help="the router's default")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        pod = Pod(settings(), Path(tmp))
        pod.process.start(pod.timeout)
        try:
            phases = {}
            for name, streams in PHASES.items():
                print(f"# {name} ...", file=sys.stderr, flush=True)
                phases[name] = asyncio.run(scrape_phase(pod, streams, args.scrapes, args.interval))
        finally:
            pod.process.stop()
    print(tables(phases, args))


if __name__ == "__main__":
    main()
