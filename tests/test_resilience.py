"""Pods failing under load: Envoy's retries, health checks and outlier detection."""

from __future__ import annotations

import asyncio
import urllib.request

import openai

from llmgw.stack import Stack
from tests.conftest import api_key

REQUESTS = 240
CONCURRENCY = 12
KILL_AFTER = 60


def metric(pod_url: str, name: str) -> float:
    """Sum of a vLLM metric's samples on one pod."""
    with urllib.request.urlopen(f"{pod_url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def busiest_pod(stack: Stack) -> int:
    """The pod with the most requests running, once one has a few (bounded wait): killed at
    once, it still has some in flight, which Envoy must retry elsewhere."""
    for _ in range(200):
        running = [metric(stack.pod_url(i), "vllm:num_requests_running") for i in range(3)]
        if max(running) >= 3:
            break
    return running.index(max(running))


async def test_killing_a_pod_under_load_fails_no_request(own_stack: Stack) -> None:
    client = openai.AsyncOpenAI(
        base_url=own_stack.base_url, api_key=api_key(own_stack), max_retries=0
    )
    model = (await client.models.list()).data[0].id
    done = 0
    victim: list[int] = []
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(i: int) -> None:
        nonlocal done
        async with gate:
            await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"request {i}"}], max_tokens=200
            )
        done += 1
        if done == KILL_AFTER:  # kill the pod with the most requests in flight
            victim.append(await asyncio.to_thread(busiest_pod, own_stack))
            own_stack.pod_processes[victim[0]].kill()

    results = await asyncio.gather(*(one(i) for i in range(REQUESTS)), return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    assert victim
    assert failures == []
    assert own_stack.envoy_stats()["cluster.pods.upstream_rq_retry"] > 0  # saved, not spared

    everyone = {f"{p.host}:{p.port}" for p in own_stack.pods}
    dead = own_stack.pods[victim[0]]
    own_stack.wait_healthy(everyone - {f"{dead.host}:{dead.port}"}, timeout=10)

    own_stack.restart_pod(victim[0])
    own_stack.wait_healthy(everyone, timeout=15)
    # The healed pod must get traffic again, and soon (slow start ramps its share up).
    healed = own_stack.pod_url(victim[0])
    for i in range(300):
        await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"after {i}"}], max_tokens=2
        )
        if metric(healed, "vllm:e2e_request_latency_seconds_count") > 0:
            break
    assert metric(healed, "vllm:e2e_request_latency_seconds_count") > 0
    await client.close()
