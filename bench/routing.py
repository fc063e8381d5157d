"""What the router is worth: Envoy least_request vs round robin vs the router, same offered load.

A simulated fleet (`--pods`, the last one `--slow-factor` times as fast) behind a fresh stack per
(workload, policy): extauthz in front every time (it mints the session IDs clients send back),
the router only in the "router" runs: "router" on its approximate prefix index alone,
"router_kv" on the pods' KV events (README, Routing). The pods and extauthz count prompts with
a tokenizer of the workloads' words (one word, one token; a chat template of role markers), so
that extauthz hashes a request's blocks as the pods do. Routing workloads, each replayed
identically (seeded) for every policy, and a priority workload:

- chat: multi-tenant chat; sessions of `--turns` turns with a long system prompt per tenant and
  the conversation so far; sessions start as a Poisson process so requests arrive at `--chat-rate`
  per second (near the fleet's capacity without the router).
- short: uniform short prompts, no shared prefixes, Poisson at `--short-rate` per second.
- large: a working set larger than a pod: `--large-prompts` distinct system prompts of
  `--system-tokens` tokens, equally popular, whose KV is `--large-cache-ratio` times one pod's
  KV cache (the pods' `--num-gpu-blocks` is set from it), so they fit the fleet's caches only
  if each lives on few pods; sessions of `--turns` turns as in chat, Poisson at `--large-rate`
  requests per second (near what the fleet serves under least_request). Before them, not
  measured, each system prompt is sent once at that rate: the working set exists, placed by the
  policy, as in a service that has been running (else most first turns of a short run would be
  a prompt's first request ever, a miss under any policy).
- evict: large, with a working set larger than the whole fleet's KV caches
  (`--evict-cache-ratio` times one pod's): the pods evict all the time, which the approximate
  index learns nothing of.
- restart: large, with the first pod restarted half way through (its cache empty afterwards;
  the approximate index still believes it holds its prompts).
- surge: long distinct prompts from the free and platinum demo tenants at an easy pace, then a
  surge of free requests (`--surge-rate` for `--surge-length` s) well past what the fleet's KV
  caches hold, so requests queue in the pods. Two stacks in the same run, the same requests:
  `priority_off` (every request reaches vLLM at priority 0: first come, first served) and
  `priority_on` (each tenant's priority as x-vllm-priority, pods on `--scheduling-policy
  priority`); TTFT and latency per tier. Envoy's least_request only, no router, so the
  difference is the pods' scheduler alone.

Reports TTFT p50/p90/p99, end-to-end latency, output tokens/s, the pods' prefix-cache hit rate
(vllm:prefix_cache_hits / queries) and requests per pod, as a table (stdout and `--out`.txt) and
a PNG (`--out`.png). The load generator's own health is reported too: how late requests were sent
against their schedule (p99) and its CPU use, so that a slow client is not mistaken for routing.

    python -m bench.routing [--duration 40] [--time-scale 1.0] [--chat-rate 8] [--short-rate 16]
        [--large-rate 24] [--large-prompts 240] [--workloads chat,short,large,surge]
        [--surge-rate 8] [--platinum-rate 2]
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
from tools.envoyconf import Address, EnvoySettings
from tools.stack import ServiceName, Stack, StackSettings

# Envoy's policy, the services, and whether the router reads the pods' KV events.
POLICIES: dict[str, tuple[str, tuple[ServiceName, ...], bool]] = {
    "least_request": ("least_request", ("extauthz",), False),
    "round_robin": ("round_robin", ("extauthz",), False),
    "router": ("least_request", ("extauthz", "router"), False),
    "router_kv": ("least_request", ("extauthz", "router"), True),
}
WORKLOADS = ("chat", "short", "large", "evict", "restart")
LARGE = ("large", "evict", "restart")  # the large sessions, with their working set warmed
SURGE = "surge"
# The surge's two stacks: does each tenant's priority reach the pods (StackSettings)?
ARMS = {"priority_off": False, "priority_on": True}
SURGE_TIERS = ("platinum", "free")
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india")


@dataclass
class Sample:
    sent: float  # scheduled send time, seconds from the run's start
    lag: float  # actual send - scheduled
    ttft: float = float("nan")
    e2e: float = float("nan")
    tokens: int = 0
    ok: bool = False
    tier: str = ""


@dataclass
class Result:
    samples: list[Sample] = field(default_factory=list)
    wall: float = 0.0
    cpu: float = 0.0  # load generator CPU seconds
    per_pod: list[int] = field(default_factory=list)
    hit_rate: float = 0.0


def text(rng: random.Random, tokens: int) -> str:
    """`tokens` tokens: as many words (the tokenizer's, `word_tokenizer`)."""
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


def word_tokenizer(directory: Path) -> Path:
    """A tokenizer.json of one token a word (the workloads' words, numbers, punctuation; any
    other word one unknown token) and a chat template of role markers, as a model's directory
    holds them."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = ["[UNK]", *WORDS, *"0123456789.,:;?!", *(str(n) for n in range(1000))]
    vocab += ["You", "are", "the", "assistant", "of", "tenant", "number", "reply"]
    vocab += ["system", "user"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(dict.fromkeys(vocab))},
                                           unk_token="[UNK]"))  # fmt: skip
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    tokenizer.save(str(path))
    (directory / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant :{% endif %}"
    )
    return path


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
        # ignore_eos: every answer exactly max_tokens long, so policies see the same work.
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
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


def api_keys(tenants: list[dict[str, str]]) -> list[str]:
    return [t["api_key"] for t in tenants]


async def run_chat(
    client: Client, tenants: list[dict[str, str]], args: argparse.Namespace
) -> list[Sample]:
    systems = [
        f"You are the assistant of tenant {t}. " + text(random.Random(t), args.system_tokens)
        for t in range(args.tenants)
    ]
    return await sessions(client, api_keys(tenants), systems, args.chat_rate, args.seed, args)


def large_systems(args: argparse.Namespace) -> list[str]:
    return [
        f"You are assistant number {p}. " + text(random.Random(-1 - p), args.system_tokens)
        for p in range(args.large_prompts)
    ]


async def run_large(
    client: Client, tenants: list[dict[str, str]], args: argparse.Namespace
) -> list[Sample]:
    systems = large_systems(args)
    return await sessions(client, api_keys(tenants), systems, args.large_rate, args.seed + 3, args)


async def warm_large(
    client: Client, tenants: list[dict[str, str]], args: argparse.Namespace
) -> list[Sample]:
    """Each system prompt once, in random order, Poisson at `--large-rate`."""
    keys = api_keys(tenants)
    rng = random.Random(args.seed + 4)
    order = list(range(args.large_prompts))
    rng.shuffle(order)
    systems = large_systems(args)
    samples: list[Sample] = []
    t = 0.0
    for _ in order:
        t += rng.expovariate(args.large_rate)
        samples.append(Sample(sent=t, lag=0.0))

    async def one(s: Sample, system: int) -> None:
        await asyncio.sleep(max(0.0, s.sent - client.now()))
        messages = [
            {"role": "system", "content": systems[system]},
            {"role": "user", "content": text(rng, args.user_tokens)},
        ]
        await client.request(s, keys[system % len(keys)], messages, args.max_tokens, None)

    await asyncio.gather(*(one(s, p) for s, p in zip(samples, order, strict=True)))
    return samples


def large_kv_blocks(args: argparse.Namespace, ratio: float | None = None) -> int:
    """Pod KV blocks such that the large workload's system prompts need `ratio` (default
    `--large-cache-ratio`) times one pod's cache."""
    per_prompt = -(-args.system_tokens // 16)
    return int(args.large_prompts * per_prompt / (ratio or args.large_cache_ratio))


def kv_blocks(workload: str, args: argparse.Namespace) -> int:
    if workload == "evict":
        return large_kv_blocks(args, args.evict_cache_ratio)
    return large_kv_blocks(args) if workload in LARGE else int(args.kv_blocks)


async def sessions(
    client: Client,
    keys: list[str],
    systems: list[str],
    rate: float,
    seed: int,
    args: argparse.Namespace,
) -> list[Sample]:
    """Sessions of `--turns` turns, each on one of `systems` (uniformly, with the API key of the
    same index: prefix caches are per tenant) starting as a Poisson process of `rate` / turns."""
    rng = random.Random(seed)
    samples: list[Sample] = []
    tasks: list[asyncio.Task[None]] = []
    session_rate = rate / args.turns
    plans = []
    t = 0.0
    while True:
        t += rng.expovariate(session_rate)
        if t >= args.duration:
            break
        system = rng.randrange(len(systems))
        turns = [text(rng, args.user_tokens) for _ in range(args.turns)]
        thinks = [rng.expovariate(1 / args.think) for _ in range(args.turns)]
        plans.append((t, system, turns, thinks))

    async def session(start: float, system: int, turns: list[str], thinks: list[float]) -> None:
        messages = [{"role": "system", "content": systems[system]}]
        session_id: str | None = None
        due = start
        for i, (user, think) in enumerate(zip(turns, thinks, strict=True)):
            await asyncio.sleep(max(0.0, due - client.now()))
            messages.append({"role": "user", "content": user})
            sample = Sample(sent=due, lag=0.0)
            samples.append(sample)
            session_id = await client.request(
                sample, keys[system % len(keys)], messages, args.max_tokens, session_id
            )
            # The reply as the next turn's history (the simulator's words, same length).
            messages.append({"role": "assistant", "content": f"reply {i} " * args.max_tokens})
            due = client.now() + think

    for plan in plans:
        tasks.append(asyncio.create_task(session(*plan)))
    await asyncio.gather(*tasks)
    return samples


async def run_short(
    client: Client, tenants: list[dict[str, str]], args: argparse.Namespace
) -> list[Sample]:
    keys = api_keys(tenants)
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


async def run_surge(
    client: Client, tenants: list[dict[str, str]], args: argparse.Namespace
) -> list[Sample]:
    rng = random.Random(args.seed + 2)
    keys = {t["tier"]: t["api_key"] for t in tenants}
    arrivals: list[tuple[float, str]] = []
    surge_end = args.surge_start + args.surge_length
    for tier, rate, start, end in (
        ("platinum", args.platinum_rate, 0.0, args.duration),
        ("free", args.free_rate, 0.0, args.duration),
        ("free", args.surge_rate, args.surge_start, surge_end),
    ):
        t = start
        while (t := t + rng.expovariate(rate)) < end:
            arrivals.append((t, tier))
    arrivals.sort()
    # Distinct prompts (no prefix-cache hits), built before the clock starts.
    prompts = [f"{rng.getrandbits(64):x} " + text(rng, args.surge_tokens) for _ in arrivals]
    samples = [Sample(sent=t, lag=0.0, tier=tier) for t, tier in arrivals]

    async def one(s: Sample, prompt: str) -> None:
        await asyncio.sleep(max(0.0, s.sent - client.now()))
        messages = [{"role": "user", "content": prompt}]
        await client.request(s, keys[s.tier], messages, args.surge_max_tokens, None)

    await asyncio.gather(*(one(s, p) for s, p in zip(samples, prompts, strict=True)))
    return samples


Runner = Callable[[Client, list[dict[str, str]], argparse.Namespace], Awaitable[list[Sample]]]
RUNNERS: dict[str, Runner] = {
    "chat": run_chat,
    "short": run_short,
    "large": run_large,
    SURGE: run_surge,
}
RUNNERS |= {"evict": run_large, "restart": run_large}
WARMUPS: dict[str, Runner] = {name: warm_large for name in LARGE}


def pod_metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        lines = resp.read().decode().splitlines()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in lines
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def counters(urls: list[str]) -> tuple[list[int], float, float]:
    """Requests per pod, prefix-cache hits and queries (tokens) over the fleet."""
    return (
        [int(pod_metric(u, "vllm:e2e_request_latency_seconds_count")) for u in urls],
        sum(pod_metric(u, "vllm:prefix_cache_hits_total") for u in urls),
        sum(pod_metric(u, "vllm:prefix_cache_queries_total") for u in urls),
    )


async def drive(stack: Stack, workload: str, args: argparse.Namespace) -> Result:
    """The workload's warm-up (if any), then the workload; the pods' counters over the latter."""
    keys = api_keys(stack.tenants)
    urls = [stack.pod_url(i) for i in range(args.pods)]
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async with session.get(
            f"{stack.base_url}/models", headers={"authorization": f"Bearer {keys[-1]}"}
        ) as r:
            model = (await r.json())["data"][0]["id"]
        if workload in WARMUPS:
            await WARMUPS[workload](Client(session, stack.base_url, model), stack.tenants, args)
        per_pod0, hits0, queries0 = counters(urls)
        cpu0 = time.process_time()
        client = Client(session, stack.base_url, model)
        restart = None
        if workload == "restart":  # the first pod, half way: a new process, an empty cache
            restart = asyncio.create_task(restarted(stack, args.duration / 2))
        samples = await RUNNERS[workload](client, stack.tenants, args)
        result = Result(samples, client.now(), time.process_time() - cpu0)
        if restart is not None:  # its counters began again from 0: what it counted before
            (requests_before,), hits_before, queries_before = await restart
            per_pod0[0] -= requests_before
            hits0 -= hits_before
            queries0 -= queries_before
    per_pod, hits, queries = counters(urls)
    result.per_pod = [n - n0 for n, n0 in zip(per_pod, per_pod0, strict=True)]
    result.hit_rate = (hits - hits0) / (queries - queries0) if queries > queries0 else 0.0
    return result


async def restarted(stack: Stack, after: float) -> tuple[list[int], float, float]:
    """Restart pod 0 `after` seconds from now; its counters just before."""
    await asyncio.sleep(after)
    before = counters([stack.pod_url(0)])
    await asyncio.to_thread(stack.restart_pod, 0)
    return before


def run_one(
    workload: str, policy: str, args: argparse.Namespace, root: Path, tokenizer: Path
) -> Result:
    fallback, services, events = POLICIES["least_request" if policy in ARMS else policy]
    pods = args.pods
    slow = ("--speed-factor", str(args.slow_factor))
    blocks = kv_blocks(workload, args)
    settings = StackSettings(
        listen=Address(port=0),
        pods=pods,
        sim_args=("--time-scale", str(args.time_scale), "--num-gpu-blocks", str(blocks)),
        pod_args=(*[()] * (pods - 1), slow),
        services=services,
        envoy=EnvoySettings(fallback_policy=fallback),  # type: ignore[arg-type]
        engine_priority=ARMS.get(policy, True),
        tokenizer=tokenizer,
        kv_events=events,
    )
    with Stack(settings, root / f"{workload}-{policy}") as stack:
        return asyncio.run(drive(stack, workload, args))


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3 if values else float("nan")


def summary(r: Result, tier: str | None = None) -> dict[str, float]:
    samples = [s for s in r.samples if tier is None or s.tier == tier]
    ok = [s for s in samples if s.ok]
    ttft = [s.ttft for s in ok]
    e2e = [s.e2e for s in ok]
    return {
        "requests": len(samples),
        "failed": len(samples) - len(ok),
        "ttft_p50": pct(ttft, 50),
        "ttft_p90": pct(ttft, 90),
        "ttft_p99": pct(ttft, 99),
        "e2e_p50": pct(e2e, 50),
        "e2e_p90": pct(e2e, 90),
        "tok_s": sum(s.tokens for s in ok) / r.wall,
        "hit": r.hit_rate * 100,
        "lag_p99": pct([s.lag for s in samples], 99),
        "cpu": r.cpu / r.wall * 100,
    }


def table(results: dict[tuple[str, str], Result], args: argparse.Namespace) -> str:
    rows = [
        f"routing: {args.pods} pods (last at speed x{args.slow_factor}), time-scale "
        f"{args.time_scale}, {args.duration:.0f} s of arrivals, KV {args.kv_blocks} blocks/pod; "
        f"chat {args.chat_rate}/s ({args.tenants} tenants, {args.system_tokens}-token system "
        f"prompts, {args.turns} turns), short {args.short_rate}/s; large {args.large_rate}/s "
        f"({args.large_prompts} system prompts, KV {args.large_cache_ratio}x one pod's: "
        f"{large_kv_blocks(args)} blocks/pod); evict: large at KV {args.evict_cache_ratio}x one "
        f"pod's ({kv_blocks('evict', args)} blocks/pod); restart: large, pod 0 restarted at "
        f"{args.duration / 2:.0f} s; ms unless noted",
        f"{'workload':<8}{'policy':<15}{'reqs':>6}{'fail':>5}{'ttft50':>8}{'ttft90':>8}"
        f"{'ttft99':>8}{'e2e50':>8}{'e2e90':>8}{'tok/s':>8}{'hit%':>6}{'lag99':>7}{'cpu%':>6}"
        "  per pod",
    ]
    for (workload, policy), r in results.items():
        if workload == SURGE:
            continue
        s = summary(r)
        rows.append(
            f"{workload:<8}{policy:<15}{s['requests']:>6.0f}{s['failed']:>5.0f}"
            f"{s['ttft_p50']:>8.0f}{s['ttft_p90']:>8.0f}{s['ttft_p99']:>8.0f}"
            f"{s['e2e_p50']:>8.0f}{s['e2e_p90']:>8.0f}{s['tok_s']:>8.0f}{s['hit']:>6.1f}"
            f"{s['lag_p99']:>7.1f}{s['cpu']:>6.0f}  {r.per_pod}"
        )
    for workload in WORKLOADS:
        for policy, against in (("router", "least_request"), ("router_kv", "router")):
            base, routed = results.get((workload, against)), results.get((workload, policy))
            if base and routed:
                b, rt = summary(base), summary(routed)
                rows.append(
                    f"{workload}: {policy} TTFT p50 {rt['ttft_p50'] / b['ttft_p50']:.2f}x, "
                    f"p90 {rt['ttft_p90'] / b['ttft_p90']:.2f}x of {against} "
                    f"(p90 {100 * (rt['ttft_p90'] - b['ttft_p90']) / b['ttft_p90']:+.1f} %)"
                )
    return "\n".join(rows)


def surge_table(results: dict[tuple[str, str], Result], args: argparse.Namespace) -> str:
    surge_end = args.surge_start + args.surge_length
    rows = [
        f"surge: {args.pods} pods (last at speed x{args.slow_factor}), time-scale "
        f"{args.time_scale}, KV {args.kv_blocks} blocks/pod, {args.duration:.0f} s of arrivals: "
        f"platinum {args.platinum_rate}/s, free {args.free_rate}/s + {args.surge_rate}/s from "
        f"{args.surge_start:.0f} to {surge_end:.0f} s; {args.surge_tokens}-token prompts, "
        f"{args.surge_max_tokens} tokens out; least_request; ms unless noted",
        f"{'arm':<14}{'tier':<10}{'reqs':>6}{'fail':>5}{'ttft50':>8}{'ttft90':>8}{'ttft99':>8}"
        f"{'e2e50':>8}{'e2e90':>8}{'lag99':>7}{'cpu%':>6}",
    ]
    for (workload, arm), r in results.items():
        if workload != SURGE:
            continue
        for tier in SURGE_TIERS:
            s = summary(r, tier)
            rows.append(
                f"{arm:<14}{tier:<10}{s['requests']:>6.0f}{s['failed']:>5.0f}"
                f"{s['ttft_p50']:>8.0f}{s['ttft_p90']:>8.0f}{s['ttft_p99']:>8.0f}"
                f"{s['e2e_p50']:>8.0f}{s['e2e_p90']:>8.0f}{s['lag_p99']:>7.1f}{s['cpu']:>6.0f}"
            )
    off, on = results.get((SURGE, "priority_off")), results.get((SURGE, "priority_on"))
    if off and on:
        for tier in SURGE_TIERS:
            p90_off, p90_on = summary(off, tier)["ttft_p90"], summary(on, tier)["ttft_p90"]
            rows.append(f"surge: {tier} p90 TTFT with priority on = {p90_on / p90_off:.2f}x of off")
    return "\n".join(rows)


def report(results: dict[tuple[str, str], Result], args: argparse.Namespace) -> str:
    parts = []
    if any(w != SURGE for w, _ in results):
        parts.append(table(results, args))
    if any(w == SURGE for w, _ in results):
        parts.append(surge_table(results, args))
    return "\n\n".join(parts)


def plot(results: dict[tuple[str, str], Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(WORKLOADS), figsize=(6 * len(WORKLOADS), 4))
    for ax, workload in zip(axes, WORKLOADS, strict=True):
        policies = [p for p in POLICIES if (workload, p) in results]
        x = np.arange(3)
        width = 0.8 / max(len(policies), 1)
        for i, policy in enumerate(policies):
            s = summary(results[(workload, policy)])
            ttft = [s["ttft_p50"], s["ttft_p90"], s["ttft_p99"]]
            ax.bar(x + i * width, ttft, width, label=policy)
        ax.set_xticks(x + 0.4 - width / 2, ["p50", "p90", "p99"])
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
    add("--large-rate", type=float, default=24.0, help="large: requests per second")
    add("--large-prompts", type=int, default=240, help="large: distinct system prompts")
    add("--large-cache-ratio", type=float, default=2.0, help="large: their KV / one pod's")
    add("--evict-cache-ratio", type=float, default=6.0, help="evict: their KV / one pod's")
    add("--max-tokens", type=int, default=48)
    add("--platinum-rate", type=float, default=2.0, help="surge: platinum requests per second")
    add("--free-rate", type=float, default=1.0, help="surge: free requests per second, always")
    add("--surge-rate", type=float, default=8.0, help="surge: more free requests per second")
    add("--surge-start", type=float, default=5.0, help="surge: seconds from the start")
    add("--surge-length", type=float, default=15.0, help="surge: seconds")
    add("--surge-tokens", type=int, default=6000, help="surge: prompt tokens of every request")
    add("--surge-max-tokens", type=int, default=192)
    add("--workloads", default=",".join((*WORKLOADS, SURGE)))
    add("--policies", default=",".join(POLICIES))
    add("--seed", type=int, default=1)
    add("--out", type=Path, default=Path(__file__).resolve().parent / "routing")
    args = parser.parse_args()
    resource.setrlimit(
        resource.RLIMIT_NOFILE, (4096, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    )
    results: dict[tuple[str, str], Result] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = word_tokenizer(Path(tmp) / "tokenizer")
        for workload in args.workloads.split(","):
            policies = list(ARMS) if workload == SURGE else args.policies.split(",")
            for policy in policies:
                run = run_one(workload, policy, args, Path(tmp), tokenizer)
                results[(workload, policy)] = run
                lines = report({(workload, policy): results[(workload, policy)]}, args)
                print("\n".join(lines.splitlines()[2 if workload == SURGE else -1 :]), flush=True)
    everything = report(results, args)
    print(everything)
    args.out.with_suffix(".txt").write_text(everything + "\n")
    if {w for w, _ in results} >= set(WORKLOADS):
        plot({k: r for k, r in results.items() if k[0] != SURGE}, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
