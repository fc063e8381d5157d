"""Pods failing under load: Envoy's retries, health checks and outlier detection."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.e2e.conftest import api_key, stack_settings
from tools.stack import Stack

REQUESTS = 36
CONCURRENCY = 12
# Each request in flight for ~1 s (600 tokens at time-scale 0.5): the kill finds the victim's
# still running however long a busy machine takes between reading its metrics and the SIGKILL
# (at the suite's 0.05, ~0.1 s: once, on a machine running two suites, they had all ended and
# nothing needed a retry).
MAX_TOKENS = 600
SLOW_PODS = ("--time-scale", "0.5")
VICTIM = 0


@pytest.fixture
def slow_stack(tmp_path: Path) -> Iterator[Stack]:
    settings = stack_settings(pods=3).model_copy(update={"sim_args": SLOW_PODS})
    with Stack(settings, tmp_path / "stack") as running:
        yield running


def metric(pod_url: str, name: str) -> float:
    """Sum of a vLLM metric's samples on one pod."""
    with urllib.request.urlopen(f"{pod_url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def kill_when_busy(stack: Stack) -> float:
    """SIGKILL the victim as soon as it has two requests running (bounded wait, whatever the
    machine's speed): it dies with requests in flight, which Envoy must retry elsewhere. The
    requests it had."""
    deadline = time.monotonic() + 60
    while True:
        running = metric(stack.pod_url(VICTIM), "vllm:num_requests_running")
        if running >= 2:
            stack.pod_processes[VICTIM].kill()
            return running
        assert time.monotonic() < deadline, "the victim never had two requests running"
        time.sleep(0.01)


async def test_killing_a_pod_under_load_fails_no_request(slow_stack: Stack) -> None:
    async with openai.AsyncOpenAI(
        base_url=slow_stack.base_url, api_key=api_key(slow_stack), max_retries=0
    ) as client:
        await _kill_under_load(slow_stack, client)


async def _kill_under_load(stack: Stack, client: openai.AsyncOpenAI) -> None:
    model = (await client.models.list()).data[0].id
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(i: int) -> None:
        async with gate:
            await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": f"request {i}"}],
                max_tokens=MAX_TOKENS,
            )

    load = asyncio.gather(*(one(i) for i in range(REQUESTS)), return_exceptions=True)
    killed_with = await asyncio.to_thread(kill_when_busy, stack)
    results = await load
    failures = [r for r in results if isinstance(r, BaseException)]
    assert killed_with >= 2
    assert failures == []
    assert stack.envoy_stats()["cluster.pods.upstream_rq_retry"] > 0  # saved, not spared

    everyone = {f"{p.host}:{p.port}" for p in stack.pods}
    dead = stack.pods[VICTIM]
    stack.wait_healthy(everyone - {f"{dead.host}:{dead.port}"}, timeout=10)

    stack.restart_pod(VICTIM)
    stack.wait_healthy(everyone, timeout=15)
    # The healed pod must get traffic again, and soon (slow start ramps its share up).
    healed = stack.pod_url(VICTIM)
    for i in range(300):
        await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"after {i}"}], max_tokens=2
        )
        if metric(healed, "vllm:e2e_request_latency_seconds_count") > 0:
            break
    assert metric(healed, "vllm:e2e_request_latency_seconds_count") > 0
