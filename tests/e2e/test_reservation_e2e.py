"""Honest reservations through the real stack: a client that names no output cap (the OpenAI
SDK's default) gets the gateway's, the pod respects it, and the token reservation holds it.

The pods here have a context of 2,048 tokens, which extauthz knows; the "free" tier's output cap
is 300, the others keep the default 4,096 (so the context bounds them).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator

import openai
import pytest

from extauthz.types import PerMinuteLimits
from tests.e2e.conftest import FAST_PODS, stack_settings
from tests.e2e.test_ratelimit_e2e import add_tenant
from tools.stack import Stack

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
CONTEXT = 2048
CAP = 300
LIMITS = (
    "tiers:\n"
    "  free: {requests: {second: 1000}, tokens: {minute: 1000000}, "
    f"max_output_tokens: {CAP}}}\n"
    "  standard: {requests: {second: 1000}, tokens: {minute: 1000000}}\n"
)
EXTAUTHZ = {
    "LLMGW_EXTAUTHZ__DECISION__MAX_MODEL_LEN": json.dumps({MODEL: CONTEXT}),
}


@pytest.fixture(scope="module")
def capped_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    state = tmp_path_factory.mktemp("capped-stack")
    (state / "limits.yaml").write_text(LIMITS)
    settings = stack_settings().model_copy(
        update={
            "tiers_file": state / "limits.yaml",
            "sim_args": (*FAST_PODS, "--max-model-len", str(CONTEXT)),
        }
    )
    with contextlib.ExitStack() as running:
        with pytest.MonkeyPatch.context() as env:  # only the services started here see it
            for name, value in EXTAUTHZ.items():
                env.setenv(name, value)
            stack = running.enter_context(Stack(settings, state / "stack"))
        yield stack


def client(stack: Stack, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.base_url, api_key=key, max_retries=0)


async def sdk_stream(sdk: openai.AsyncOpenAI, content: str) -> tuple[int, str | None]:
    """A stream as the SDK sends it by default (no max_tokens), to a model that never stops by
    itself (vLLM's ignore_eos): (completion tokens, finish_reason)."""
    chunks = await sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    completion, finish = 0, None
    async for chunk in chunks:
        if chunk.usage is not None:
            completion = chunk.usage.completion_tokens
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
    return completion, finish


async def test_a_stream_without_max_tokens_ends_at_the_gateways_cap(capped_stack: Stack) -> None:
    async with client(capped_stack, add_tenant(capped_stack, "cap-free", "free")) as sdk:
        assert await sdk_stream(sdk, "tell me everything") == (CAP, "length")

    # The default cap (4,096) is above this model's context: the pod gets the context instead
    # (it refuses a max_tokens above max_model_len) and fills what fits beside the prompt.
    async with client(capped_stack, add_tenant(capped_stack, "cap-standard", "standard")) as sdk:
        reply = await sdk.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "tell me everything"}],
            extra_body={"ignore_eos": True},
        )
    assert reply.usage is not None
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.total_tokens == CONTEXT


async def test_concurrent_sdk_default_streams_stay_within_a_small_tpm(capped_stack: Stack) -> None:
    """Before: each stream reserved its prompt + 256 and generated up to the context, so a
    tenant was served several times its per-minute tokens in one minute."""
    tpm, streams = 1500, 12
    key = add_tenant(capped_stack, "cap-tpm", "free", PerMinuteLimits(tpm=tpm))
    async with client(capped_stack, key) as sdk:

        async def one(i: int) -> tuple[int, str | None] | None:
            try:
                return await sdk_stream(sdk, f"question {i}: go on forever")
            except openai.RateLimitError:
                return None

        results = await asyncio.gather(*(one(i) for i in range(streams)))
    served = [r for r in results if r is not None]
    completion = sum(tokens for tokens, _ in served)
    print(f"{len(served)}/{streams} streams served, {completion} completion tokens, TPM {tpm}")
    assert served and len(served) < streams  # the limit was reached
    assert all(r == (CAP, "length") for r in served)
    assert completion <= tpm + CAP  # within the limit plus one request
