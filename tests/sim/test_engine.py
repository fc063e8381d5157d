"""Continuous batching: shared steps, queueing, KV exhaustion, prefix cache, determinism."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from typing import Any

import aiohttp
import pytest

from sim import SimPod
from sim.profile import PROFILES, StepLoad, decode_step_seconds, step_seconds
from tests.sim.conftest import MakePod, chat, drained

H100 = PROFILES["h100-llama-8b"]


def prefill_seconds(tokens: int) -> float:
    load = StepLoad()
    load.add(0, tokens)
    return step_seconds(H100, load)


pytestmark = pytest.mark.timeout(30)


async def complete(http: aiohttp.ClientSession, pod: SimPod, body: dict[str, Any]) -> Any:
    async with http.post(pod.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def with_peaks(pod: SimPod, work: Awaitable[Any]) -> tuple[Any, int, int]:
    """Run `work`, sampling the engine; returns its result and the peak running and waiting."""
    peaks = [0, 0]
    done = asyncio.Event()

    async def sample() -> None:
        while not done.is_set():
            running, waiting, _ = pod.engine.gauges()
            peaks[0], peaks[1] = max(peaks[0], running), max(peaks[1], waiting)
            await asyncio.sleep(0.0005)

    sampler = asyncio.create_task(sample())
    try:
        result = await work
    finally:
        done.set()
        await sampler
    return result, peaks[0], peaks[1]


async def test_concurrent_requests_share_steps(
    make_pod: MakePod, http: aiohttp.ClientSession
) -> None:
    pod = await make_pod(time_scale=1.0)  # requests last long enough to overlap on a busy box
    start = pod.engine.sim_now()
    await complete(http, pod, chat("warm up", max_tokens=32, ignore_eos=True))
    one = pod.engine.sim_now() - start
    start = pod.engine.sim_now()
    bodies = [chat(f"question {i}", max_tokens=32, ignore_eos=True) for i in range(16)]
    replies, running, _ = await with_peaks(
        pod, asyncio.gather(*(complete(http, pod, b) for b in bodies))
    )
    together = pod.engine.sim_now() - start
    assert all(r["usage"]["completion_tokens"] == 32 for r in replies)
    assert running > 1
    assert together < 0.35 * 16 * one  # serial would take 16 x one


async def test_few_seats_make_requests_wait(make_pod: MakePod, http: aiohttp.ClientSession) -> None:
    pod = await make_pod(max_num_seqs=2, time_scale=0.1)
    bodies = [chat(f"q{i}", max_tokens=20) for i in range(8)]
    replies, running, waiting = await with_peaks(
        pod, asyncio.gather(*(complete(http, pod, b) for b in bodies))
    )
    assert len(replies) == 8
    assert running == 2 and waiting > 0


async def test_kv_exhaustion_queues_and_preempts(
    make_pod: MakePod, http: aiohttp.ClientSession
) -> None:
    pod = await make_pod(num_gpu_blocks=24, time_scale=0.1)  # 384 tokens in all
    bodies = [
        chat(f"{i} " + "lorem ipsum " * 12, max_tokens=120, ignore_eos=True) for i in range(6)
    ]
    replies, _, waiting = await with_peaks(
        pod, asyncio.gather(*(complete(http, pod, b) for b in bodies))
    )
    assert all(r["usage"]["completion_tokens"] == 120 for r in replies)
    assert waiting > 0
    assert pod.stats.preemptions > 0
    assert pod.engine.gauges() == (0, 0, 0.0)  # every block released


async def test_max_model_len_is_capped_by_the_kv_cache(make_pod: MakePod) -> None:
    pod = await make_pod(num_gpu_blocks=10, block_size=16)
    assert pod.settings.max_model_len == 160


SYSTEM = "You are a meticulous assistant. " * 120  # ~960 tokens


async def test_shared_system_prompt_hits_the_prefix_cache(
    pod: SimPod, http: aiohttp.ClientSession
) -> None:
    ttfts = []
    for question in ("question one", "question two"):
        before = pod.stats.ttft.total
        body = {
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": question},
            ],
            "max_tokens": 2,
        }
        prompt_tokens = (await complete(http, pod, body))["usage"]["prompt_tokens"]
        ttfts.append(pod.stats.ttft.total - before)
    assert pod.stats.prefix_queries == 2 * prompt_tokens
    hits = pod.stats.prefix_hits
    assert hits >= 900 and pod.stats.prompt_tokens_cached == hits
    saved = prefill_seconds(prompt_tokens) - prefill_seconds(prompt_tokens - hits)
    assert saved > 0.02  # compute-bound prefill: ~0.04 ms per token
    assert ttfts[1] == pytest.approx(ttfts[0] - saved, rel=0.05)


async def test_simulated_latencies_follow_the_profile(
    make_pod: MakePod, http: aiohttp.ClientSession
) -> None:
    pod = await make_pod()
    fast = await make_pod(speed_factor=2.0)
    for each in (pod, fast):
        await complete(http, each, chat("x" * 400, max_tokens=11))
    prompt = pod.stats.prompt_tokens
    # Each later token: one decode step of a batch of 1 over the context so far.
    itl = sum(decode_step_seconds(H100, 1, prompt + k) for k in range(10))
    assert pod.stats.itl.total == pytest.approx(itl)
    assert fast.stats.itl.total == pytest.approx(itl / 2)
    # TTFT: API overhead + one step prefilling the whole prompt.
    ttft = H100.request_overhead_ms / 1e3 + prefill_seconds(prompt)
    assert pod.stats.ttft.total == pytest.approx(ttft)
    assert fast.stats.ttft.total == pytest.approx(ttft / 2)


async def test_same_seed_and_prompt_give_the_same_completion(
    make_pod: MakePod, http: aiohttp.ClientSession
) -> None:
    a, b, other = await make_pod(seed=7), await make_pod(seed=7), await make_pod(seed=8)
    body = chat("the same prompt")
    first, second = await complete(http, a, body), await complete(http, b, body)
    again = await complete(http, a, body)
    assert first["choices"][0]["message"] == second["choices"][0]["message"]
    assert first["usage"] == second["usage"] == again["usage"]
    assert again["choices"][0]["message"] == first["choices"][0]["message"]
    assert (await complete(http, other, body))["choices"] != first["choices"]


async def test_stream_is_incremental_and_disconnect_frees_the_sequence(
    make_pod: MakePod, http: aiohttp.ClientSession
) -> None:
    pod = await make_pod(time_scale=1.0)  # real H100 pace: 200 tokens take ~1.3 s
    body = chat("long answer", max_tokens=200, ignore_eos=True, stream=True)
    async with http.post(pod.url + "/v1/chat/completions", json=body) as resp:
        await resp.content.readuntil(b"\n\n")  # the role chunk, sent with the first token
        await resp.content.readuntil(b"\n\n")
        assert pod.stats.generation_tokens < 200
        assert pod.engine.gauges()[0] == 1
        resp.close()
    assert await drained(pod)
    assert pod.stats.generation_tokens < 200


async def test_stop_ends_with_an_eos_token_counted_in_usage(
    pod: SimPod, http: aiohttp.ClientSession
) -> None:
    reply = await complete(http, pod, chat("tell me"))
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert pod.stats.generation_tokens == reply["usage"]["completion_tokens"]
    body = chat("tell me", stream=True)
    async with http.post(pod.url + "/v1/chat/completions", json=body) as resp:
        events = [e for e in (await resp.text()).split("\n\n") if e.startswith("data: {")]
    last = json.loads(events[-1].removeprefix("data: "))["choices"][0]
    assert last["delta"] == {"content": ""} and last["finish_reason"] == "stop"
    assert len(events) == 1 + reply["usage"]["completion_tokens"]  # role + one per token


async def test_each_request_is_charged_its_share_of_every_step_it_was_in(
    make_pod: MakePod, http: aiohttp.ClientSession
) -> None:
    """The exact GPU time the ledger's estimate is measured against (bench/gputime.py): a step
    shared by a batch of B costs each of them 1/B of what it took on the wall clock (at least its
    simulated time; more on a busy machine); the shares add up to the steps' time."""
    # Slow enough (64 steps of ~4 ms) that 8 requests sent at once overlap for most of their
    # steps even when a busy machine's client sends them tens of milliseconds apart.
    scale = 0.2
    pod = await make_pod(time_scale=scale)
    start = pod.engine.sim_now()
    alone = "alone-1"
    async with http.post(
        pod.url + "/v1/chat/completions",
        json=chat("alone", max_tokens=8, ignore_eos=True),
        headers={"X-Request-Id": alone},
    ) as resp:
        assert resp.status == 200
    busy = (pod.engine.sim_now() - start) * scale
    spent = pod.engine.gpu_seconds
    assert spent[alone] >= busy * 0.999  # alone: every step was its own
    start = pod.engine.sim_now()
    names = [f"together-{i}" for i in range(8)]

    async def one(name: str) -> None:
        body = chat(name, max_tokens=64, ignore_eos=True)
        async with http.post(
            pod.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": name}
        ) as resp:
            assert resp.status == 200

    await asyncio.gather(*map(one, names))
    busy = (pod.engine.sim_now() - start) * scale
    shares = [spent[n] for n in names]
    assert sum(shares) >= busy * 0.999
    assert max(shares) < sum(shares) / 2  # each shared its steps with the others
    async with http.get(pod.url + "/admin/gpu_seconds") as resp:
        assert (await resp.json())[alone] == pytest.approx(spent[alone])
