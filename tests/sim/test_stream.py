"""Streams as vLLM 0.32 sends them: chunk fields, the usage behaviours, n > 1, list prompts."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from sim import SimPod
from tests.sim.conftest import MakePod, chat

pytestmark = pytest.mark.timeout(30)


async def events(http: aiohttp.ClientSession, pod: SimPod, path: str, body: Any) -> list[Any]:
    """The stream's JSON events, in order ([DONE] checked and dropped)."""
    async with http.post(pod.url + path, json=body | {"stream": True}) as resp:
        assert resp.status == 200
        raw = (await resp.text()).split("\n\n")
    assert raw[-2:] == ["data: [DONE]", ""]
    return [json.loads(e.removeprefix("data: ")) for e in raw[:-2]]


async def test_chat_chunks_carry_the_fields_vllm_sets(
    pod: SimPod, http: aiohttp.ClientSession
) -> None:
    role, *tokens = await events(http, pod, "/v1/chat/completions", chat("hi", max_tokens=3))
    head = ["id", "object", "created", "model", "choices"]
    assert list(role) == [*head, "prompt_token_ids", "prompt_text"]
    assert role["prompt_token_ids"] is None and role["prompt_text"] is None
    assert role["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
         "finish_reason": None}
    ]  # fmt: skip
    *middle, last = tokens
    assert all(list(t) == head for t in middle)
    assert list(middle[0]["choices"][0]) == [
        "index", "delta", "logprobs", "finish_reason", "token_ids"]  # fmt: skip
    # No usage chunk follows: the finishing chunk carries the fingerprint.
    assert list(last) == [*head, "system_fingerprint"]
    assert last["system_fingerprint"].startswith("vllm-0.32.0-")
    final = last["choices"][0]
    assert list(final) == [
        "index", "delta", "logprobs", "finish_reason", "stop_reason", "token_ids"]  # fmt: skip
    assert final["finish_reason"] == "length" and final["stop_reason"] is None


async def test_completion_chunks_carry_the_fields_vllm_sets(
    pod: SimPod, http: aiohttp.ClientSession
) -> None:
    chunks = await events(http, pod, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert len(chunks) == 2
    assert list(chunks[0]["choices"][0]) == [
        "index", "text", "logprobs", "finish_reason", "stop_reason", "prompt_token_ids",
        "token_ids"]  # fmt: skip
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_whole_replies_carry_every_field(pod: SimPod, http: aiohttp.ClientSession) -> None:
    async with http.post(pod.url + "/v1/chat/completions", json=chat("hi")) as resp:
        reply = await resp.json()
    assert list(reply) == [
        "id", "object", "created", "model", "choices", "service_tier", "system_fingerprint",
        "usage", "prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params",
        "ec_transfer_params", "metrics"]  # fmt: skip
    message = reply["choices"][0]["message"]
    assert "tool_calls" not in message and message["reasoning"] is None  # empty list dropped
    assert list(reply["usage"]) == [
        "prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details",
        "completion_tokens_details"]  # fmt: skip


def usages(chunks: list[Any]) -> list[Any]:
    return [c.get("usage") for c in chunks]


async def test_no_usage_unless_asked(pod: SimPod, http: aiohttp.ClientSession) -> None:
    body = chat("hi", max_tokens=3, stream_options={})  # include_usage defaults to false
    chunks = await events(http, pod, "/v1/chat/completions", body)
    assert usages(chunks) == [None] * 4


async def test_include_usage_adds_one_usage_only_chunk(
    pod: SimPod, http: aiohttp.ClientSession
) -> None:
    body = chat("hi", max_tokens=3, stream_options={"include_usage": True})
    *chunks, last = await events(http, pod, "/v1/chat/completions", body)
    assert usages(chunks) == [None] * 4
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3
    head = ["id", "object", "created", "model", "choices"]
    assert list(last) == [*head, "usage", "system_fingerprint"]
    assert "system_fingerprint" not in chunks[-1]  # the usage chunk is the last one


async def test_continuous_usage_stats_put_usage_on_every_chunk(
    pod: SimPod, http: aiohttp.ClientSession
) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = chat("hi", max_tokens=3, stream_options=options)
    chunks = await events(http, pod, "/v1/chat/completions", body)
    counts = [u["completion_tokens"] for u in usages(chunks)]
    assert counts == [0, 1, 2, 3, 3]  # role, three tokens, the usage-only chunk
    assert chunks[0]["usage"]["completion_tokens_details"] is None
    body = {"prompt": "x", "max_tokens": 2, "stream_options": options}
    chunks = await events(http, pod, "/v1/completions", body)
    assert [u["completion_tokens"] for u in usages(chunks)] == [1, 2, 2]
    assert "completion_tokens_details" not in chunks[0]["usage"]


@pytest.mark.parametrize(
    ("mode", "counts"), [("per-chunk", [0, 1, 2, 2]), ("final", [None, None, None, 2])]
)
async def test_force_include_usage_modes(
    make_pod: MakePod, http: aiohttp.ClientSession, mode: str, counts: list[int | None]
) -> None:
    pod = await make_pod(force_include_usage=True, usage_mode=mode)
    chunks = await events(http, pod, "/v1/chat/completions", chat("hi", max_tokens=2))
    assert [u and u["completion_tokens"] for u in usages(chunks)] == counts
    assert chunks[-1]["choices"] == []


async def test_n_samples_stream_and_reply_as_separate_choices(
    pod: SimPod, http: aiohttp.ClientSession
) -> None:
    async with http.post(pod.url + "/v1/chat/completions", json=chat("hi", n=3)) as resp:
        reply = await resp.json()
    texts = [c["message"]["content"] for c in reply["choices"]]
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2] and len(set(texts)) == 3
    chunks = await events(http, pod, "/v1/chat/completions", chat("hi", n=3))
    roles = [c["choices"][0]["index"] for c in chunks[:3]]
    assert roles == [0, 1, 2] and all("role" in c["choices"][0]["delta"] for c in chunks[:3])
    streamed = {i: "" for i in range(3)}
    for c in chunks[3:]:
        streamed[c["choices"][0]["index"]] += c["choices"][0]["delta"]["content"]
    assert list(streamed.values()) == texts  # the same seed gives the same samples
    finished = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1, 2]
    prompt = reply["usage"]["prompt_tokens"]
    ones = await pod_usage(http, pod, chat("hi"))
    assert prompt == ones["prompt_tokens"]  # the prompt counts once for n samples


async def pod_usage(http: aiohttp.ClientSession, pod: SimPod, body: Any) -> Any:
    async with http.post(pod.url + "/v1/chat/completions", json=body) as resp:
        return (await resp.json())["usage"]


async def test_list_prompts_are_one_choice_each(pod: SimPod, http: aiohttp.ClientSession) -> None:
    body = {"prompt": ["x" * 40, "y" * 80], "max_tokens": 4, "n": 2}
    async with http.post(pod.url + "/v1/completions", json=body) as resp:
        reply = await resp.json()
    assert [c["index"] for c in reply["choices"]] == list(range(4))
    assert reply["usage"]["prompt_tokens"] == 10 + 20
    assert reply["usage"]["completion_tokens"] == 4 * 4
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = await events(http, pod, "/v1/completions", body | {"stream_options": options})
    by_choice = {c["choices"][0]["index"]: c["usage"]["prompt_tokens"] for c in chunks[:-1]}
    assert by_choice == {0: 10, 1: 10, 2: 20, 3: 20}
    async with http.post(pod.url + "/v1/completions", json={"prompt": [[1, 2, 3], [4]]}) as resp:
        assert (await resp.json())["usage"]["prompt_tokens"] == 4  # token IDs count as given
    mixed = {"prompt": ["text", [1, 2]]}  # not one of vLLM's prompt types
    async with http.post(pod.url + "/v1/completions", json=mixed) as resp:
        assert resp.status == 400
