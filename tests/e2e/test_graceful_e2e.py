"""Graceful ends through the real stack (seed 003 §3.3): a tenant's hard budget is enforced by
the output cap the pod receives, so a stream that reaches it ends like any stream (finish_reason
"length" and a usage chunk) and the next request is insufficient_quota; a client that hangs up
frees its pod slot at once.

The pods run at half their real pace (a token every ~3 ms), so a long generation lasts seconds
and a pod that went on generating for a client that left would be seen doing it.
"""

from __future__ import annotations

import http.client
import json
import math
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import openai
import pytest

from llmgw.facts import MESSAGE_TOKENS
from tests.e2e.conftest import stack_settings
from tests.e2e.test_ratelimit_e2e import add_tenant, auth, counter, reservations
from tests.eventually import eventually
from tools.stack import Stack

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
BUDGET = 600
LIMITS = (
    "tiers:\n"
    "  standard: {requests: {second: 1000}, tokens: {minute: 1000000}}\n"
    "  capped: {requests: {second: 1000}, tokens: {minute: 1000000}, "
    f"budget: {{tokens: {BUDGET}, per: day}}}}\n"
)
RUNNING = "vllm:num_requests_running"
GENERATED = "vllm:generation_tokens_total"


@pytest.fixture(scope="module")
def graceful_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    state = tmp_path_factory.mktemp("graceful-stack")
    (state / "limits.yaml").write_text(LIMITS)
    settings = stack_settings().model_copy(
        update={"tiers_file": state / "limits.yaml", "sim_args": ("--time-scale", "0.5")}
    )
    with Stack(settings, state / "stack") as running:
        yield running


def estimate(content: str) -> int:
    """extauthz's prompt estimate of one user message: its text and role (4 characters a token)
    and the chat template's tokens around it (llmgw/facts.py)."""
    return math.ceil((len(content) + len("user")) / 4) + 2 * MESSAGE_TOKENS


def settled(stack: Stack, tenant: str) -> int:
    """The tenant's budget use once every reservation is settled (bounded wait)."""
    eventually(lambda: not reservations(stack, tenant), 10, "the ledger did not settle")
    return counter(stack, tenant, "budget:day")


async def stream(
    sdk: openai.AsyncOpenAI, content: str, **extra: object
) -> tuple[int | None, str | None, int]:
    """A stream with usage to a model that never stops by itself (vLLM's ignore_eos):
    (completion tokens of the usage chunk, the last finish_reason, content events)."""
    chunks = await sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, **extra},
    )
    completion, finish, events = None, None, 0
    async for chunk in chunks:
        if chunk.usage is not None:
            completion = chunk.usage.completion_tokens
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            events += bool(choice.delta.content)
    return completion, finish, events


async def test_a_stream_that_runs_into_the_budget_ends_with_length_then_insufficient_quota(
    graceful_stack: Stack,
) -> None:
    key = add_tenant(graceful_stack, "gr-budget", "capped")
    async with openai.AsyncOpenAI(
        base_url=graceful_stack.base_url, api_key=key, max_retries=0
    ) as sdk:
        first = await sdk.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=100,
            extra_body={"ignore_eos": True},
        )
        assert first.usage is not None and first.usage.completion_tokens == 100
        used = settled(graceful_stack, "gr-budget")  # the real usage of the first request
        assert 100 < used < BUDGET

        # No max_tokens (the SDK's default): extauthz caps the output at what the whole budget
        # leaves beside the prompt, more than is left of it now. Before, this was refused outright;
        # now the pod gets the cap that fits and the stream ends as any stream that hits its cap.
        content = "tell me a very long story, and never stop"
        cap = BUDGET - used - estimate(content)
        completion, finish, events = await stream(sdk, content)
        assert (completion, finish, events) == (cap, "length", cap)

        # Spent: what is left (nothing before settlement; less than nothing after, the pod's real
        # prompt being longer than the estimate) does not hold a prompt and one token.
        with pytest.raises(openai.RateLimitError) as refused:
            await stream(sdk, content)
        error = refused.value.body
        assert isinstance(error, dict) and error["code"] == "insufficient_quota"
        assert refused.value.response.headers["x-should-retry"] == "false"


async def test_a_forged_cap_from_the_client_has_no_effect(graceful_stack: Stack) -> None:
    """The lowered cap travels in the rate-limit filter's dynamic metadata, which no client can
    write; a header or body member of the same name is the client's own text, nothing more."""
    key = add_tenant(graceful_stack, "gr-forge", "capped")
    async with openai.AsyncOpenAI(
        base_url=graceful_stack.base_url,
        api_key=key,
        max_retries=0,
        default_headers={"x-llmgw-output-cap": "3"},
    ) as sdk:
        # Fits the budget whole: the client's own cap of 40 stands, not the forged 3.
        completion, finish, _ = await stream(sdk, "hi", max_tokens=40, output_cap=3)
        assert (completion, finish) == (40, "length")
        used = settled(graceful_stack, "gr-forge")
        # Runs into the budget: the budget's cap, neither the forged 3 nor the client's 5,000.
        content = "go on and on"
        cap = BUDGET - used - estimate(content)
        completion, finish, _ = await stream(sdk, content, max_tokens=5000, output_cap=3)
        assert (completion, finish) == (cap, "length")


def metric(stack: Stack, name: str) -> float:
    """A vLLM metric summed over the stack's pods."""
    total = 0.0
    for i in range(len(stack.pods)):
        with urllib.request.urlopen(f"{stack.pod_url(i)}/metrics", timeout=5) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith((name + "{", name + " ")):
                    total += float(line.rsplit(" ", 1)[1])
    return total


def wait_for_metric(stack: Stack, name: str, done: object, within_s: float) -> float:
    """Seconds until `done(value)` holds for the summed metric; fails after `within_s`."""
    return eventually(
        lambda: done(metric(stack, name)),  # type: ignore[operator]
        within_s,
        lambda: f"{name} is still {metric(stack, name)}",
        every_s=0.02,
    )


def hang_up_after(stack: Stack, key: str, stream: bool, events: int) -> None:
    """A generation of 4,000 tokens (~13 s at this pace) the client leaves: after `events` SSE
    events of a stream, or once the pod runs a non-streaming one."""
    url = urlsplit(stack.base_url)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=30)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "a long story"}],
        "max_tokens": 4000,
        "ignore_eos": True,
        "stream": stream,
    }
    headers = {**auth(key), "content-type": "application/json"}
    conn.request("POST", f"{url.path}/chat/completions", json.dumps(body), headers)
    if stream:
        reply = conn.getresponse()
        assert reply.status == 200
        seen = 0
        while seen < events:
            line = reply.readline()
            assert line, "the stream ended before the client hung up"
            seen += line.startswith(b"data: {")
    else:
        wait_for_metric(stack, RUNNING, lambda v: v >= 1, 10)
    assert conn.sock is not None
    conn.sock.close()
    conn.close()


@pytest.mark.parametrize("streaming", [True, False], ids=["stream", "whole"])
def test_a_client_that_hangs_up_frees_its_pod_slot(graceful_stack: Stack, streaming: bool) -> None:
    """Envoy resets the upstream request when its client leaves, and the pod aborts it (as vLLM
    does): the sequence leaves the running batch within a bound and generates nothing more."""
    key = add_tenant(
        graceful_stack, "gr-hangup-" + ("stream" if streaming else "whole"), "standard"
    )
    wait_for_metric(graceful_stack, RUNNING, lambda v: v == 0, 10)  # earlier tests' are done
    before = metric(graceful_stack, GENERATED)
    with ThreadPoolExecutor(1) as pool:
        pool.submit(hang_up_after, graceful_stack, key, streaming, 20).result(timeout=30)
    freed = wait_for_metric(graceful_stack, RUNNING, lambda v: v == 0, 2.0)
    generated = metric(graceful_stack, GENERATED) - before
    print(f"slot freed {freed * 1000:.0f} ms after the hang-up; {generated:.0f} tokens generated")
    time.sleep(0.5)  # ~150 tokens' time: a pod still generating would be seen doing it
    assert metric(graceful_stack, GENERATED) - before == generated
    assert generated < 1000  # of 4,000
