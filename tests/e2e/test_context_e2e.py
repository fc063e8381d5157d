"""SDK-default requests against pods with a short context: the gateway's output cap never turns
a request the pod would serve into an error.

The pods run with `--max-model-len 1200` (as vLLM pods often do, to save memory) and nobody tells
extauthz: the router reads the context from the pods' /v1/models. The tiers keep their default
output cap, 4,096, which every pod would refuse above its context (before: 0 of 30 SDK-default
streams served, by simulated pods and by a real vLLM 0.32 pod alike). Simulated pods, and a real
vLLM pod in the real-vLLM tier (tests/e2e/realpods.py: under `make test` it waits for the
environment, installed meanwhile; LLMGW_STACK__VLLM__VENV and friends choose it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import openai
import pytest

from tests.e2e.conftest import FAST_PODS, api_key, stack_settings
from tests.e2e.realpods import MARKS, vllm_settings_or_skip
from tests.http import call
from tools.stack import Stack

CONTEXT = 1200
STREAMS = 30


# The real pod with the real-vLLM tier (last: its environment may still be installing).
@pytest.fixture(scope="module", params=["sim", pytest.param("vllm", marks=MARKS)])
def short_context_stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    settings = stack_settings().model_copy(
        update={"sim_args": (*FAST_PODS, "--max-model-len", str(CONTEXT))}
    )
    if request.param == "vllm":
        # One pod: a real one takes a core and ~1.25 GB.
        vllm = vllm_settings_or_skip().model_copy(update={"max_model_len": CONTEXT})
        settings = stack_settings(pods=1).model_copy(update={"engine": "vllm", "vllm": vllm})
    with Stack(settings, tmp_path_factory.mktemp("short-context") / "stack") as stack:
        yield stack


def model(stack: Stack) -> str:
    served = stack.serving[0].model
    assert served is not None
    return served


def sdk(stack: Stack) -> openai.AsyncOpenAI:
    """The OpenAI SDK as an application uses it: its defaults, retries included."""
    return openai.AsyncOpenAI(base_url=stack.base_url, api_key=api_key(stack, "standard"))


async def stream(
    client: openai.AsyncOpenAI, name: str, content: str, ignore_eos: bool = False
) -> tuple[int, int, str | None]:
    """One SDK-default stream (no max_tokens): (prompt tokens, completion tokens, finish)."""
    chunks = await client.chat.completions.create(
        model=name,
        messages=[{"role": "user", "content": content}],
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True} if ignore_eos else None,
    )
    prompt, completion, finish = 0, 0, None
    async for chunk in chunks:
        if chunk.usage is not None:
            prompt, completion = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
    return prompt, completion, finish


async def test_sdk_default_requests_are_all_served(short_context_stack: Stack) -> None:
    name = model(short_context_stack)
    async with sdk(short_context_stack) as client:
        streams = await asyncio.gather(
            *(stream(client, name, f"question {i}: tell me about the sea") for i in range(STREAMS)),
            return_exceptions=True,
        )
        served = [r for r in streams if not isinstance(r, BaseException)]
        print(f"{len(served)} of {STREAMS} SDK-default streams served: {outcomes(streams)}")
        whole = await asyncio.gather(
            *(
                client.chat.completions.create(
                    model=name, messages=[{"role": "user", "content": f"whole {i}"}]
                )
                for i in range(5)
            ),
            return_exceptions=True,
        )
        assert len(served) == STREAMS and not any(isinstance(r, BaseException) for r in whole)
        # One that never stops by itself runs to the context: the pod lowered the gateway's
        # cap to what fits beside the prompt, as it does for a client's own. Streamed: a real
        # pod on a busy machine took longer to write its ~1,190 tokens than the stack's idle
        # timeout allows a whole reply to be silent.
        endless = await stream(client, name, "go on forever", ignore_eos=True)
    for prompt, completion, finish in served:
        assert completion >= 1 and finish in ("stop", "length")
        assert prompt + completion <= CONTEXT
    prompt, completion, finish = endless
    assert prompt + completion == CONTEXT and finish == "length"


def outcomes(results: list[object]) -> dict[str, int]:
    """How many requests ended how: "served", or the error's status."""
    counted: dict[str, int] = {}
    for r in results:
        name = "served"
        if isinstance(r, BaseException):
            name = str(r.status_code) if isinstance(r, openai.APIStatusError) else repr(r)
        counted[name] = counted.get(name, 0) + 1
    return counted


def test_a_request_that_cannot_fit_gets_the_pods_own_400(short_context_stack: Stack) -> None:
    """A cap the client names above the context, or a prompt longer than it: the same answer
    as the pod gives without the gateway."""
    stack = short_context_stack
    pod_key = {"authorization": f"Bearer {stack.pod_api_key}"} if stack.pod_api_key else {}
    # Another tenant than the other test's: a client's 400s count on its tenant's breaker.
    gateway_key = {"authorization": f"Bearer {api_key(stack, 'platinum')}"}
    for fields in (
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": CONTEXT + 1},
        {"messages": [{"role": "user", "content": "word " * (4 * CONTEXT)}]},
    ):
        body = {"model": model(stack), **fields}
        direct = call("POST", f"{stack.pod_url(0)}/v1/chat/completions", body, pod_key)
        through = call("POST", f"{stack.base_url}/chat/completions", body, gateway_key)
        assert direct.status == through.status == 400, through.body
        assert through.json()["error"]["message"] == direct.json()["error"]["message"]
