"""What the router is worth: Envoy least_request vs round robin vs the router, same offered load.

A simulated fleet (`--pods`, the last one `--slow-factor` times as fast) behind a fresh stack per
(workload, policy): extauthz in front every time (it mints the session IDs clients send back),
the router only in the "router" runs. Two workloads, each replayed identically (seeded) for every
policy:

- chat: multi-tenant chat; sessions of `--turns` turns with a long system prompt per tenant and
  the conversation so far; sessions start as a Poisson process so requests arrive at `--chat-rate`
  per second (near the fleet's capacity without the router).
- short: uniform short prompts, no shared prefixes, Poisson at `--short-rate` per second.

Reports TTFT p50/p90/p99, end-to-end latency, output tokens/s, the pods' prefix-cache hit rate
(vllm:prefix_cache_hits / queries) and requests per pod, as a table (stdout and `--out`.txt) and
a PNG (`--out`.png). The load generator's own health is reported too: how late requests were sent
against their schedule (p99) and its CPU use, so that a slow client is not mistaken for routing.

    python -m bench.routing [--duration 40] [--time-scale 1.0] [--chat-rate 8] [--short-rate 16]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import resource
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

from llmgw import wire
from llmgw.envoyconf import Address, EnvoySettings
from llmgw.stack import ServiceName, Stack, StackSettings

POLICIES: dict[str, tuple[str, tuple[ServiceName, ...]]] = {
    "least_request": ("least_request", ("extauthz",)),
    "round_robin": ("round_robin", ("extauthz",)),
    "router": ("least_request", ("extauthz", "router")),
}
WORKLOADS = ("chat", "short")
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india")


@dataclass
class Sample:
    sent: float  # scheduled send time, seconds from the run's start
    lag: float  # actual send - scheduled
    ttft: float = float("nan")
    e2e: float = float("nan")
    tokens: int = 0
    ok: bool = False


@dataclass
class Result:
    samples: list[Sample] = field(default_factory=list)
    wall: float = 0.0
    cpu: float = 0.0  # load generator CPU seconds
    per_pod: list[int] = field(default_factory=list)
    hit_rate: float = 0.0


def text(rng: random.Random, tokens: int) -> str:
    """About `tokens` tokens (the simulator counts 4 characters a token)."""
    out: list[str] = []
    size = 0
    while size < tokens * 4:
        word = rng.choice(WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)


class Client:
    def __init__(self, session: aiohttp.ClientSession, base_url: str, model: str) -> None:
        self.session = session
        self.url = f"{base_url}/chat/completions"
        self.model = model
        self.started = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.started

    async def request(
        self,
        sample: Sample,
        key: str,
        messages: list[dict[str, str]],
        max_tokens: int,
        session_id: str | None,
    ) -> str | None:
        """One streamed completion; fills `sample`, returns the session ID the gateway gave."""
        headers = {"authorization": f"Bearer {key}"}
        if session_id:
            headers[wire.HEADER_SESSION] = session_id
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "stream": True}
        sample.lag = self.now() - sample.sent
        start = time.perf_counter()
        try:
            async with self.session.post(self.url, json=body, headers=headers) as resp:
                if resp.status != 200:
                    await resp.read()
                    return session_id
                async for line in resp.content:
                    if line.startswith(b"data: ") and b'"content"' in line:
                        if sample.tokens == 0:
                            sample.ttft = time.perf_counter() - start
                        sample.tokens += 1
                sample.e2e = time.perf_counter() - start
                sample.ok = sample.tokens > 0
                return resp.headers.get(wire.HEADER_SESSION, session_id)
        except (aiohttp.ClientError, TimeoutError):
            return session_id


async def run_chat(client: Client, keys: list[str], args: argparse.Namespace) -> list[Sample]:
    rng = random.Random(args.seed)
    systems = [
        f"You are the assistant of tenant {t}. " + text(random.Random(t), args.system_tokens)
        for t in range(args.tenants)
    ]
    samples: list[Sample] = []
    tasks: list[asyncio.Task[None]] = []
    session_rate = args.chat_rate / args.turns
    plans = []
    t = 0.0
    while True:
        t += rng.expovariate(session_rate)
        if t >= args.duration:
            break
        tenant = rng.randrange(args.tenants)
        turns = [text(rng, args.user_tokens) for _ in range(args.turns)]
        thinks = [rng.expovariate(1 / args.think) for _ in range(args.turns)]
        plans.append((t, tenant, turns, thinks))

    async def session(start: float, tenant: int, turns: list[str], thinks: list[float]) -> None:
        messages = [{"role": "system", "content": systems[tenant]}]
        session_id: str | None = None
        due = start
        for i, (user, think) in enumerate(zip(turns, thinks, strict=True)):
            await asyncio.sleep(max(0.0, due - client.now()))
            messages.append({"role": "user", "content": user})
            sample = Sample(sent=due, lag=0.0)
            samples.append(sample)
            session_id = await client.request(
                sample, keys[tenant % len(keys)], messages, args.max_tokens, session_id
            )
            # The reply as the next turn's history (the simulator's words, same length).
            messages.append({"role": "assistant", "content": f"reply {i} " * args.max_tokens})
            due = client.now() + think

    for plan in plans:
        tasks.append(asyncio.create_task(session(*plan)))
    await asyncio.gather(*tasks)
    return samples


async def run_short(client: Client, keys: list[str], args: argparse.Namespace) -> list[Sample]:
    rng = random.Random(args.seed + 1)
    samples: list[Sample] = []
    tasks = []
    t = 0.0
    while True:
        t += rng.expovariate(args.short_rate)
        if t >= args.duration:
            break
        prompt = f"{rng.getrandbits(64):x} " + text(rng, args.short_tokens)
        sample = Sample(sent=t, lag=0.0)
        samples.append(sample)

        async def one(s: Sample = sample, p: str = prompt, k: str = rng.choice(keys)) -> None:
            await asyncio.sleep(max(0.0, s.sent - client.now()))
            await client.request(s, k, [{"role": "user", "content": p}], args.max_tokens, None)

        tasks.append(asyncio.create_task(one()))
    await asyncio.gather(*tasks)
    return samples


Runner = Callable[[Client, list[str], argparse.Namespace], Awaitable[list[Sample]]]
RUNNERS: dict[str, Runner] = {"chat": run_chat, "short": run_short}


def pod_metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        lines = resp.read().decode().splitlines()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in lines
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


async def drive(stack: Stack, workload: str, args: argparse.Namespace) -> Result:
    keys = [t["api_key"] for t in stack.tenants]
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async with session.get(
            f"{stack.base_url}/models", headers={"authorization": f"Bearer {keys[-1]}"}
        ) as r:
            model = (await r.json())["data"][0]["id"]
        cpu0 = time.process_time()
        client = Client(session, stack.base_url, model)
        samples = await RUNNERS[workload](client, keys, args)
        return Result(samples, client.now(), time.process_time() - cpu0)


def run_one(workload: str, policy: str, args: argparse.Namespace, root: Path) -> Result:
    fallback, services = POLICIES[policy]
    pods = args.pods
    slow = ("--speed-factor", str(args.slow_factor))
    settings = StackSettings(
        listen=Address(port=0),
        pods=pods,
        sim_args=("--time-scale", str(args.time_scale), "--num-gpu-blocks", str(args.kv_blocks)),
        pod_args=(*[()] * (pods - 1), slow),
        services=services,
        envoy=EnvoySettings(fallback_policy=fallback),  # type: ignore[arg-type]
    )
    with Stack(settings, root / f"{workload}-{policy}") as stack:
        result = asyncio.run(drive(stack, workload, args))
        urls = [stack.pod_url(i) for i in range(pods)]
        result.per_pod = [
            int(pod_metric(u, "vllm:e2e_request_latency_seconds_count")) for u in urls
        ]
        hits = sum(pod_metric(u, "vllm:prefix_cache_hits_total") for u in urls)
        queries = sum(pod_metric(u, "vllm:prefix_cache_queries_total") for u in urls)
        result.hit_rate = hits / queries if queries else 0.0
    return result


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3 if values else float("nan")


def summary(r: Result) -> dict[str, float]:
    ok = [s for s in r.samples if s.ok]
    ttft = [s.ttft for s in ok]
    e2e = [s.e2e for s in ok]
    return {
        "requests": len(r.samples),
        "failed": len(r.samples) - len(ok),
        "ttft_p50": pct(ttft, 50),
        "ttft_p90": pct(ttft, 90),
        "ttft_p99": pct(ttft, 99),
        "e2e_p50": pct(e2e, 50),
        "e2e_p90": pct(e2e, 90),
        "tok_s": sum(s.tokens for s in ok) / r.wall,
        "hit": r.hit_rate * 100,
        "lag_p99": pct([s.lag for s in r.samples], 99),
        "cpu": r.cpu / r.wall * 100,
    }


def table(results: dict[tuple[str, str], Result], args: argparse.Namespace) -> str:
    rows = [
        f"routing: {args.pods} pods (last at speed x{args.slow_factor}), time-scale "
        f"{args.time_scale}, {args.duration:.0f} s of arrivals, KV {args.kv_blocks} blocks/pod; "
        f"chat {args.chat_rate}/s ({args.tenants} tenants, {args.system_tokens}-token system "
        f"prompts, {args.turns} turns), short {args.short_rate}/s; ms unless noted",
        f"{'workload':<8}{'policy':<15}{'reqs':>6}{'fail':>5}{'ttft50':>8}{'ttft90':>8}"
        f"{'ttft99':>8}{'e2e50':>8}{'e2e90':>8}{'tok/s':>8}{'hit%':>6}{'lag99':>7}{'cpu%':>6}"
        "  per pod",
    ]
    for (workload, policy), r in results.items():
        s = summary(r)
        rows.append(
            f"{workload:<8}{policy:<15}{s['requests']:>6.0f}{s['failed']:>5.0f}"
            f"{s['ttft_p50']:>8.0f}{s['ttft_p90']:>8.0f}{s['ttft_p99']:>8.0f}"
            f"{s['e2e_p50']:>8.0f}{s['e2e_p90']:>8.0f}{s['tok_s']:>8.0f}{s['hit']:>6.1f}"
            f"{s['lag_p99']:>7.1f}{s['cpu']:>6.0f}  {r.per_pod}"
        )
    for workload in WORKLOADS:
        base = results.get((workload, "least_request"))
        routed = results.get((workload, "router"))
        if base and routed:
            b, r = summary(base)["ttft_p90"], summary(routed)["ttft_p90"]
            rows.append(f"{workload}: router p90 TTFT {100 * (r - b) / b:+.1f} % vs least_request")
    return "\n".join(rows)


def plot(results: dict[tuple[str, str], Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(WORKLOADS), figsize=(6 * len(WORKLOADS), 4))
    for ax, workload in zip(axes, WORKLOADS, strict=True):
        policies = [p for p in POLICIES if (workload, p) in results]
        x = np.arange(3)
        for i, policy in enumerate(policies):
            s = summary(results[(workload, policy)])
            ax.bar(x + i * 0.27, [s["ttft_p50"], s["ttft_p90"], s["ttft_p99"]], 0.27, label=policy)
        ax.set_xticks(x + 0.27, ["p50", "p90", "p99"])
        ax.set_ylabel("TTFT (ms)")
        ax.set_yscale("log")
        ax.set_title(workload)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--pods", type=int, default=4)
    add("--slow-factor", type=float, default=0.5, help="speed factor of the last pod")
    add("--time-scale", type=float, default=1.0, help="wall seconds per simulated second")
    add("--kv-blocks", type=int, default=1200, help="KV-cache blocks per pod")
    add("--duration", type=float, default=40.0, help="seconds of arrivals per run")
    add("--chat-rate", type=float, default=8.0, help="chat requests per second")
    add("--tenants", type=int, default=8)
    add("--system-tokens", type=int, default=3000)
    add("--turns", type=int, default=4)
    add("--user-tokens", type=int, default=40)
    add("--think", type=float, default=1.0, help="mean seconds between a reply and the next turn")
    add("--short-rate", type=float, default=16.0, help="short requests per second")
    add("--short-tokens", type=int, default=100)
    add("--max-tokens", type=int, default=48)
    add("--workloads", default=",".join(WORKLOADS))
    add("--policies", default=",".join(POLICIES))
    add("--seed", type=int, default=1)
    add("--out", type=Path, default=Path(__file__).resolve().parent / "routing")
    args = parser.parse_args()
    resource.setrlimit(
        resource.RLIMIT_NOFILE, (4096, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    )
    results: dict[tuple[str, str], Result] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for workload in args.workloads.split(","):
            for policy in args.policies.split(","):
                results[(workload, policy)] = run_one(workload, policy, args, Path(tmp))
                print(
                    table({(workload, policy): results[(workload, policy)]}, args).splitlines()[-1],
                    flush=True,
                )
    report = table(results, args)
    print(report)
    args.out.with_suffix(".txt").write_text(report + "\n")
    if {w for w, _ in results} >= set(WORKLOADS):
        plot(results, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
