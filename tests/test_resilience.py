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


def served_requests(pod_url: str) -> float:
    with urllib.request.urlopen(f"{pod_url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:e2e_request_latency_seconds_count")
    )


async def test_killing_a_pod_under_load_fails_no_request(own_stack: Stack) -> None:
    client = openai.AsyncOpenAI(
        base_url=own_stack.base_url, api_key=api_key(own_stack), max_retries=0
    )
    model = (await client.models.list()).data[0].id
    done = 0
    killed = asyncio.Event()
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(i: int) -> None:
        nonlocal done
        async with gate:
            await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"request {i}"}], max_tokens=16
            )
        done += 1
        if done == KILL_AFTER:
            own_stack.pod_processes[0].kill()
            killed.set()

    results = await asyncio.gather(*(one(i) for i in range(REQUESTS)), return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    assert killed.is_set()
    assert failures == []
    assert own_stack.envoy_stats()["cluster.pods.upstream_rq_retry"] > 0  # saved, not spared

    everyone = {f"{p.host}:{p.port}" for p in own_stack.pods}
    dead = f"{own_stack.pods[0].host}:{own_stack.pods[0].port}"
    own_stack.wait_healthy(everyone - {dead}, timeout=10)

    own_stack.restart_pod(0)
    own_stack.wait_healthy(everyone, timeout=15)
    # Slow start ramps the healed pod's share up; it must get traffic again, and soon.
    for i in range(300):
        await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"after {i}"}], max_tokens=2
        )
        if served_requests(own_stack.pod_url(0)) > 0:
            break
    assert served_requests(own_stack.pod_url(0)) > 0
    await client.close()
