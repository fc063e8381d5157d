"""The gateway's added latency in front of a real vLLM pod against in front of the simulator.

Two stacks of one pod each, the full chain in front (the gateway topology, as `llmgw up` runs
it): one with a real vLLM CPU pod (`engine: vllm`), one with a simulated pod serving the same
model name. Non-stream chat requests with `max_tokens` 1, one at a time at a low fixed rate,
interleaved request by request over the four paths (each pod directly, with its key, and through
its gateway, with a platinum tenant's key; the order rotates every cycle so that each path follows
each other equally often). Added = through the gateway − directly, per quantile, for each engine,
with a bootstrap interval of the added p50; the two must agree within noise, or the simulator's
overhead figures are not to be trusted. Then CPU per request of every process (bench/cpu.py's
/proc accounting, each process with its threads and children), less what each burns idle (the
router scrapes each pod every 75 ms), measured in an idle window beforehand.

    python -m bench.vllm_overhead [--samples 200] [--rate 5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.cpu import cpu_seconds
from bench.loadgen import Conn, Samples, Target
from bench.vllm_pod import processes
from llmgw import config
from tools.envoyconf import Address
from tools.stack import Stack, StackSettings

PROMPT = [{"role": "user", "content": "Summarise the plot of a short story in one line."}]
ENGINES = ("vllm", "sim")
PATHS = ("direct", "gateway")
Route = tuple[str, str]  # (engine, path)
BOOTSTRAP = 2000


@dataclass
class Run:
    samples: dict[Route, Samples] = field(default_factory=dict)
    elapsed: float = 0.0


def stack_settings(engine: str, model: str) -> StackSettings:
    """The stack `llmgw up` would start (its environment overrides too), with one pod."""
    base = config.load(StackSettings, None, "LLMGW_STACK")
    update: dict[str, object] = {"listen": Address(port=0), "pods": 1, "engine": engine}
    if engine == "sim":
        update["sim_args"] = ("--model", model)
    return base.model_copy(update=update)


def targets(stacks: dict[str, Stack]) -> dict[Route, Target]:
    out = {}
    for engine, stack in stacks.items():
        pod = stack.pods[0]
        out[(engine, "direct")] = Target(pod.host, pod.port, api_key=stack.pod_api_key or "")
        platinum = next(t["api_key"] for t in stack.tenants if t["tier"] == "platinum")
        out[(engine, "gateway")] = Target(stack.listen.host, stack.listen.port, api_key=platinum)
    return out


async def interleave(
    targets: dict[Route, Target], body: dict[str, object], cycles: int, rate: float
) -> Run:
    """`cycles` requests per path, one at a time, request i sent at i / rate (or when the one
    before it is answered, if later)."""
    conns = {p: await Conn.open(t) for p, t in targets.items()}
    requests = {p: t.request(body) for p, t in targets.items()}
    run = Run({p: Samples() for p in targets})
    order = list(targets)
    start = time.perf_counter()
    i = 0
    for cycle in range(cycles):
        for p in order[cycle % len(order) :] + order[: cycle % len(order)]:
            await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
            status, first, total, keep = await conns[p].exchange(requests[p])
            run.samples[p].add(status, first, total)
            if not keep:
                conns[p].close()
                conns[p] = await Conn.open(targets[p])
            i += 1
    run.elapsed = time.perf_counter() - start
    for conn in conns.values():
        conn.close()
    return run


def roots(stacks: dict[str, Stack]) -> dict[str, int]:
    """engine/process → pid: every child of each stack (with its children), and the real pod's
    EngineCore and Worker apart as `vllm/pod: ROLE`."""
    out = {}
    for engine, stack in stacks.items():
        for proc in stack.processes:
            if proc.pid is not None:
                out[f"{engine}/{'pod' if proc.name == 'pod-0' else proc.name}"] = proc.pid
    for role, pid in processes(out["vllm/pod"]).items():
        out[f"vllm/pod: {role}"] = pid
    return out


def own(cpu: dict[str, float]) -> dict[str, float]:
    """The real pod's processes without their children: each is its parent's child
    (bench/vllm_pod.py PROCESSES), and `cpu_seconds` counts a process with its descendants."""
    out = dict(cpu)
    chain = ["vllm/pod: API server", "vllm/pod: EngineCore", "vllm/pod: Worker"]
    for parent, child in itertools.pairwise(chain):
        if child in cpu:
            out[parent] = cpu[parent] - cpu[child]
    return out


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3


def percentiles(values: list[float], q: float, rng: np.random.Generator) -> np.ndarray:
    """The q-th percentile (ms) of each of BOOTSTRAP resamples of `values`."""
    v = np.asarray(values)
    draws: np.ndarray = np.percentile(rng.choice(v, (BOOTSTRAP, v.size)), q, axis=1)
    return draws * 1e3


def interval(draws: np.ndarray) -> str:
    """The 90 % interval of bootstrap draws."""
    lo, hi = np.percentile(draws, (5, 95))
    return f"{lo:+.2f} … {hi:+.2f}"


def latency_table(run: Run, args: argparse.Namespace) -> str:
    lines = [
        f"Added latency, real vLLM CPU pod against the simulator: non-stream chat, max_tokens 1, "
        f"{args.samples} requests per path one at a time at {args.rate:g} req/s in all, "
        f"interleaved request by request ({run.elapsed:.0f} s); client-side, request written → "
        "last byte read",
        "",
        "| engine | path | p50 ms | p90 ms | p99 ms | samples | non-200 |",
        "|---|---|---|---|---|---|---|",
    ]
    for (engine, path), s in run.samples.items():
        lines.append(
            f"| {engine} | {path} | {pct(s.total, 50):.2f} | {pct(s.total, 90):.2f} "
            f"| {pct(s.total, 99):.2f} | {s.count} | {s.errors} |"
        )
    lines += [
        "",
        "| engine | added p50 ms | 90 % interval | added p90 ms | 90 % interval |",
        "|---|---|---|---|---|",
    ]
    rng = np.random.default_rng(24)
    added: dict[tuple[str, int], float] = {}
    draws: dict[tuple[str, int], np.ndarray] = {}  # bootstrap draws of the added quantile
    for engine in ENGINES:
        direct = run.samples[(engine, "direct")].total
        gateway = run.samples[(engine, "gateway")].total
        cells = [engine]
        for q in (50, 90):
            added[(engine, q)] = pct(gateway, q) - pct(direct, q)
            draws[(engine, q)] = percentiles(gateway, q, rng) - percentiles(direct, q, rng)
            cells += [f"{added[(engine, q)]:+.2f}", interval(draws[(engine, q)])]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for q in (50, 90):
        ratio = added[("vllm", q)] / added[("sim", q)]
        gap = added[("vllm", q)] - added[("sim", q)]
        lines.append(
            f"- added p{q}, vllm / sim: **{ratio:.2f}×**; vllm − sim {gap:+.2f} ms, 90 % "
            f"interval {interval(draws[('vllm', q)] - draws[('sim', q)])} ms"
        )
    return "\n".join(lines)


def cpu_table(
    used: dict[str, float], idle: dict[str, float], window: float, args: argparse.Namespace
) -> str:
    """µs per request of each process, its idle burn over the window subtracted."""
    lines = [
        f"CPU per request, µs (utime+stime from /proc over the run, less each process's idle "
        f"rate measured over {args.idle_seconds:g} s beforehand; a pod's requests are both its "
        "paths', a gateway's its own; the real pod's Worker busy-polls for 1 s after each step, "
        "so at this rate it spins throughout: its figure is a core divided by the pod's req/s)",
        "",
        "| engine | process | per request µs | idle ms/s |",
        "|---|---|---|---|",
    ]
    gateway: dict[str, float] = {}
    pod: dict[str, float] = {}
    for name, seconds in own(used).items():
        engine, process = name.split("/")
        n = args.samples * (2 if process.startswith("pod") else 1)
        us = (seconds - own(idle)[name] * window) / n * 1e6
        if process == "pod":
            pod[engine] = us
        elif ":" not in process:  # the pod's parts are in its row already
            gateway[engine] = gateway.get(engine, 0.0) + us
        lines.append(f"| {engine} | {process} | {us:,.0f} | {own(idle)[name] * 1e3:.1f} |")
    for engine, us in gateway.items():
        lines.append(f"| {engine} | **the gateway (all but the pod)** | **{us:,.0f}** | |")
    for engine, us in gateway.items():
        lines.append(f"| {engine} | **all** | **{us + pod[engine]:,.0f}** | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200, help="per path")
    parser.add_argument("--rate", type=float, default=5.0, help="req/s over all four paths")
    parser.add_argument("--warm", type=int, default=20, help="requests per path first, unrecorded")
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    parser.add_argument("--settle-seconds", type=float, default=1.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as running:
        model = stack_settings("vllm", "").vllm.served_model_name
        stacks = {}
        for engine in ENGINES:
            print(f"# starting the {engine} stack ...", file=sys.stderr, flush=True)
            settings = stack_settings(engine, model)
            stacks[engine] = running.enter_context(Stack(settings, Path(tmp) / engine))
        paths = targets(stacks)
        body: dict[str, object] = {"model": model, "messages": PROMPT, "max_tokens": 1}
        print("# warming up ...", file=sys.stderr, flush=True)
        warm = asyncio.run(interleave(paths, body, args.warm, args.rate))
        if any(s.errors for s in warm.samples.values()):
            statuses = {f"{e}/{p}": s.statuses for (e, p), s in warm.samples.items()}
            print(f"# warm-up statuses {statuses}", file=sys.stderr)
        pids = roots(stacks)
        print("# idle ...", file=sys.stderr, flush=True)
        time.sleep(2.0)  # the real pod's Worker busy-polls for 1 s after its last step
        idle0 = cpu_seconds(pids)
        time.sleep(args.idle_seconds)
        idle1 = cpu_seconds(pids)
        idle = {k: (idle1[k] - idle0[k]) / args.idle_seconds for k in pids}
        print("# measuring ...", file=sys.stderr, flush=True)
        t0, cpu0 = time.perf_counter(), cpu_seconds(pids)
        run = asyncio.run(interleave(paths, body, args.samples, args.rate))
        time.sleep(args.settle_seconds)  # the last access-log batches are flushed and handled
        cpu1, window = cpu_seconds(pids), time.perf_counter() - t0
    used = {k: cpu1[k] - cpu0[k] for k in pids}
    print(latency_table(run, args))
    print()
    print(cpu_table(used, idle, window, args))


if __name__ == "__main__":
    main()
