"""Router pick time in the service (span + candidates + filters + scorers + picker + in-flight),
for 16 and 256 pods, and the cost of parsing one vLLM /metrics page.

    .venv/bin/python -m bench.router_pick [--picks 5000]

Targets (issue 5): pick p50 < 0.3 ms at 16 pods and < 1 ms at 256 pods.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from opentelemetry.sdk.trace import TracerProvider
from prometheus_client.parser import text_string_to_metric_families

from llmgw.facts import block_hashes, render
from llmgw.telemetry import parent_context
from router.collectors.scrape import parse_metrics
from router.engine import Engine
from router.fleet import Fleet, FleetSettings
from router.registry import DEFAULT_PLUGINS, DEFAULT_PROFILE, default_registry
from router.runtime import Router
from router.types import PickRequest, PodMetrics


def fleet_of(n: int, rng: random.Random) -> Fleet:
    fleet = Fleet(FleetSettings(capacity=64, stale_after=3600))
    pods = [f"10.{i // 250}.{i % 250}.1:8000" for i in range(n)]
    fleet.set_pods(pods)
    for pod in pods:
        fleet.snapshots[pod] = PodMetrics(
            pod,
            fleet.clock(),
            ok=True,
            running=rng.randint(0, 60),
            waiting=rng.randint(0, 6),
            kv_usage=rng.random() * 0.9,
            block_size=16,
            num_gpu_blocks=20000,
            models=frozenset({"m"}),
        )
    return fleet


def requests(count: int, rng: random.Random) -> list[tuple[PickRequest, dict[str, str]]]:
    systems = [f"You are the assistant of tenant {t}. " * 40 for t in range(8)]
    out = []
    for _ in range(count):
        tenant = rng.randrange(8)
        headers = {"x-session-id": f"sess_{rng.randrange(500)}"}
        body = {
            "messages": [
                {"role": "system", "content": systems[tenant]},
                {"role": "user", "content": f"question {rng.random()} " * 20},
            ]
        }
        req = PickRequest(
            model="m",
            tenant=f"t{tenant}",
            priority=rng.randint(1, 10),
            session=headers["x-session-id"],
            prefix_blocks=block_hashes(render(body), 64),
        )
        out.append((req, headers))
    return out


def bench_picks(n_pods: int, picks: int) -> tuple[float, float]:
    rng = random.Random(n_pods)
    fleet = fleet_of(n_pods, rng)
    engine = Engine(default_registry().build(DEFAULT_PLUGINS, DEFAULT_PROFILE))
    tracer = TracerProvider().get_tracer("bench")  # recording spans, no exporter
    router = Router(fleet, engine, tracer)
    reqs = requests(picks, rng)
    times = []
    for req, headers in reqs:
        t0 = time.perf_counter()
        chosen = router.pick(req, parent_context(None, headers))
        times.append(time.perf_counter() - t0)
        if chosen is not None:
            fleet.release(chosen.pods[0])
    times = times[picks // 10 :]  # warm-up
    q = statistics.quantiles(times, n=100)
    return q[49] * 1e3, q[98] * 1e3


def bench_parse(rounds: int = 300) -> tuple[float, float]:
    page = (
        "\n".join(
            [
                'vllm:num_requests_running{engine="0",model_name="m"} 12.0',
                'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0',
                'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.42',
                'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="20000"} 1.0',
            ]
            + [  # histograms dominate a real page
                f'vllm:{h}_bucket{{engine="0",le="{le}",model_name="m"}} {i}.0'
                for h in (
                    "time_to_first_token_seconds",
                    "inter_token_latency_seconds",
                    "e2e_request_latency_seconds",
                    "request_prompt_tokens",
                    "request_generation_tokens",
                    "request_queue_time_seconds",
                )
                for i, le in enumerate(
                    [
                        "0.001",
                        "0.005",
                        "0.01",
                        "0.02",
                        "0.04",
                        "0.06",
                        "0.08",
                        "0.1",
                        "0.25",
                        "0.5",
                        "1.0",
                        "2.5",
                        "5.0",
                        "10.0",
                        "+Inf",
                    ]
                )
            ]
        )
        + "\n"
    )
    t0 = time.perf_counter()
    for _ in range(rounds):
        parse_metrics(page)
    ours = (time.perf_counter() - t0) / rounds
    t0 = time.perf_counter()
    for _ in range(rounds):
        for _family in text_string_to_metric_families(page):
            pass
    theirs = (time.perf_counter() - t0) / rounds
    return ours * 1e6, theirs * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--picks", type=int, default=5000)
    args = parser.parse_args()
    print("| pods | pick p50 (ms) | pick p99 (ms) | target p50 |")
    print("|---:|---:|---:|---:|")
    for n, target in ((16, 0.3), (256, 1.0)):
        p50, p99 = bench_picks(n, args.picks)
        print(f"| {n} | {p50:.3f} | {p99:.3f} | < {target} |")
    ours, theirs = bench_parse()
    print(f"\n/metrics page parse: ours {ours:.0f} µs, prometheus_client {theirs:.0f} µs")


if __name__ == "__main__":
    main()
