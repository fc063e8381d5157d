"""The pod looks like a vLLM OpenAI server to the official SDK and to a Prometheus scraper."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from sim import SimPod
from tests.sim.conftest import MakePod, chat

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def client(pod: SimPod) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=pod.url + "/v1", api_key="unused", max_retries=0)


async def test_chat_non_stream_parses_with_the_sdk(pod: SimPod) -> None:
    async with client(pod) as sdk:
        reply = await sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=7
        )
    assert reply.id.startswith("chatcmpl-")
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 7
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 7


async def test_reply_ids_name_the_request_as_vllm_does(
    pod: SimPod, http: aiohttp.ClientSession
) -> None:
    """X-Request-Id, else the body's request_id (the gateway sends both), else 16 hex digits."""
    ids = []
    for headers, fields in (
        ({"X-Request-Id": "hdr"}, {"request_id": "body"}),
        ({}, {"request_id": "body"}),
        ({}, {}),
    ):
        body = chat("hi", max_tokens=1, **fields)
        async with http.post(pod.url + "/v1/chat/completions", json=body, headers=headers) as resp:
            ids.append((await resp.json())["id"])
    assert ids[:2] == ["chatcmpl-hdr", "chatcmpl-body"]
    assert ids[2].startswith("chatcmpl-") and len(ids[2]) == len("chatcmpl-") + 16
    int(ids[2].removeprefix("chatcmpl-"), 16)


async def test_chat_stream_sends_role_then_one_token_per_chunk(pod: SimPod) -> None:
    async with client(pod) as sdk:
        stream = await sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=5, stream=True
        )
        chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    tokens = [c.choices[0].delta.content for c in chunks[1:]]
    assert len(tokens) == 5 and all(tokens)
    assert [c.choices[0].finish_reason for c in chunks[1:]] == [None] * 4 + ["length"]
    assert all(c.usage is None for c in chunks)
    assert {c.id for c in chunks} == {chunks[0].id}


async def test_completion_stream_and_non_stream(pod: SimPod) -> None:
    async with client(pod) as sdk:
        whole = await sdk.completions.create(model=MODEL, prompt="Once upon", max_tokens=6)
        stream = await sdk.completions.create(
            model=MODEL, prompt="Once upon", max_tokens=6, stream=True
        )
        chunks = [chunk async for chunk in stream]
    assert whole.id.startswith("cmpl-") and whole.object == "text_completion"
    assert whole.usage is not None and whole.usage.completion_tokens == 6
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert len(chunks) == 6 and chunks[-1].choices[0].finish_reason == "length"


async def test_include_usage_ends_the_stream_with_a_usage_chunk(pod: SimPod) -> None:
    async with client(pod) as sdk:
        stream = await sdk.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 3
    assert all(c.usage is None for c in chunks[:-1])


async def test_raw_stream_framing(pod: SimPod, http: aiohttp.ClientSession) -> None:
    body = chat("hi", model=MODEL, max_tokens=2, stream=True)
    async with http.post(pod.url + "/v1/chat/completions", json=body) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = (await resp.read()).decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: {") for e in events[:-2])
    assert len(events) == 2 + 1 + 2  # [DONE], trailing "", role, two tokens


async def test_default_length_is_bounded_and_stops(
    pod: SimPod, http: aiohttp.ClientSession
) -> None:
    async with http.post(pod.url + "/v1/completions", json={"prompt": "tell me"}) as resp:
        reply = await resp.json()
    natural = reply["usage"]["completion_tokens"]
    assert 16 <= natural <= 256
    assert reply["choices"][0]["finish_reason"] == "stop"
    # A cap above the natural length does not make the model go on (vLLM stops at EOS): the
    # gateway names a cap on every request. ignore_eos runs to it; a smaller one cuts it.
    for extra, expected, reason in (
        ({"max_tokens": natural + 5}, natural, "stop"),
        ({"max_tokens": natural + 5, "ignore_eos": True}, natural + 5, "length"),
        ({"max_tokens": natural - 1}, natural - 1, "length"),
    ):
        async with http.post(pod.url + "/v1/completions", json={"prompt": "tell me", **extra}) as r:
            reply = await r.json()
        assert reply["usage"]["completion_tokens"] == expected
        assert reply["choices"][0]["finish_reason"] == reason


async def test_ignore_eos_without_max_tokens_runs_to_the_context_limit(
    make_pod: MakePod, http: aiohttp.ClientSession
) -> None:
    pod = await make_pod(max_model_len=300)
    body = {"prompt": "x" * 40, "ignore_eos": True}  # 10 prompt tokens
    async with http.post(pod.url + "/v1/completions", json=body) as resp:
        reply = await resp.json()
    assert reply["usage"]["completion_tokens"] == 290
    assert reply["choices"][0]["finish_reason"] == "length"


async def test_models_has_vllm_shape(pod: SimPod, http: aiohttp.ClientSession) -> None:
    async with client(pod) as sdk:
        models = await sdk.models.list()
    assert [m.id for m in models.data] == [MODEL]
    async with http.get(pod.url + "/v1/models") as resp:
        assert resp.content_type == "application/json"
        card = (await resp.json())["data"][0]
    assert card["owned_by"] == "vllm" and card["max_model_len"] == 131072


async def test_health_is_200_with_an_empty_body(pod: SimPod, http: aiohttp.ClientSession) -> None:
    async with http.get(pod.url + "/health") as resp:
        assert resp.status == 200 and await resp.read() == b""


ERRORS: list[tuple[str, Any, int, str, str | None]] = [
    # Request-model validation (pydantic through FastAPI): "Bad Request" and the field path.
    ("/v1/chat/completions", "{not json", 400, "Bad Request", "body.1"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "Bad Request", "body.messages"),
    ("/v1/completions", {"prompt": "x", "priority": "high"}, 400, "Bad Request", "body.priority"),
    ("/v1/completions", {"prompt": "x", "priority": 1.5}, 400, "Bad Request", "body.priority"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "Bad Request",
     "body.max_tokens"),
    ("/v1/chat/completions", [1, 2], 400, "Bad Request", "body"),
    # The models' mode="before" validators raise VLLMValidationError, which pydantic does not
    # wrap: "BadRequestError" and the parameter, as the serving code's checks.
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "BadRequestError", "stream_options"),
    ("/v1/completions", {"model": MODEL}, 400, "BadRequestError", "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "BadRequestError", "prompt"),
    ("/v1/completions", {"prompt": "x", "cache_salt": ""}, 400, "BadRequestError", "cache_salt"),
    ("/v1/completions", {"prompt": "x", "cache_salt": 5}, 400, "BadRequestError", "cache_salt"),
    ("/v1/chat/completions", chat("x", cache_salt="a/b"), 400, "BadRequestError", "cache_salt"),
    ("/v1/chat/completions", chat("x", cache_salt="a" * 129), 400, "BadRequestError",
     "cache_salt"),
    # Checks in the serving code and SamplingParams: "BadRequestError" and the parameter.
    ("/v1/completions", {"prompt": []}, 400, "BadRequestError", None),
    ("/v1/completions", {"prompt": [""]}, 400, "BadRequestError", None),
    ("/v1/chat/completions", {"messages": []}, 400, "BadRequestError", None),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "NotFoundError", "model"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "BadRequestError", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "BadRequestError", "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": 3}, 400, "BadRequestError",
     "temperature"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 200_000}, 400, "BadRequestError",
     "max_tokens"),
    ("/v1/chat/completions", chat("x", max_completion_tokens=200_000), 400, "BadRequestError",
     "max_completion_tokens"),
    ("/v1/chat/completions", chat("x" * 600_000), 400, "BadRequestError", "input_tokens"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "status", "type_", "param"), ERRORS)
async def test_errors_have_vllm_shape(
    pod: SimPod,
    http: aiohttp.ClientSession,
    path: str,
    body: Any,
    status: int,
    type_: str,
    param: str | None,
) -> None:
    data = body if isinstance(body, str) else json.dumps(body)
    headers = {"Content-Type": "application/json"}
    async with http.post(pod.url + path, data=data, headers=headers) as resp:
        assert resp.status == status
        assert resp.headers["content-type"] == "application/json"  # no charset, as vLLM
        error = await resp.json()
    assert error == {
        "error": {"message": error["error"]["message"], "type": type_, "param": param,
                  "code": status}
    }  # fmt: skip
    assert error["error"]["message"]


async def test_validation_messages_are_vllms(pod: SimPod, http: aiohttp.ClientSession) -> None:
    body = {"prompt": "x", "priority": "high"}
    async with http.post(pod.url + "/v1/completions", json=body) as resp:
        message = (await resp.json())["error"]["message"]
    assert message == (
        "1 validation error:\n  {'type': 'int_parsing', 'loc': 'body.priority', 'msg': 'Input "
        "should be a valid integer, unable to parse string as an integer', 'input': 'high'}"
    )
    async with http.post(pod.url + "/v1/completions", json={"model": "m", "prompt": "x"}) as resp:
        message = (await resp.json())["error"]["message"]
    assert message == f"The model `m` does not exist. Valid aliases: {MODEL}."


async def test_a_body_that_is_not_json_typed_is_rejected(
    pod: SimPod, http: aiohttp.ClientSession
) -> None:
    data = json.dumps({"prompt": "x"})
    async with http.post(pod.url + "/v1/completions", data=data) as resp:  # text/plain
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error["type"] == "Bad Request" and "Only 'application/json'" in error["message"]


async def test_unknown_routes_answer_like_starlette(
    pod: SimPod, http: aiohttp.ClientSession
) -> None:
    async with http.get(pod.url + "/v2/nothing") as resp:
        assert resp.status == 404 and await resp.json() == {"detail": "Not Found"}
    async with http.get(pod.url + "/v1/completions") as resp:
        assert resp.status == 405 and await resp.json() == {"detail": "Method Not Allowed"}


@pytest.mark.parametrize(
    "fields",
    [
        {"priority": "3"},  # pydantic's lax mode parses it
        {"priority": -(2**63)},
        {"stream_options": {}},  # falsy: vLLM's check reads `data.get("stream_options")`
        {"temperature": 0, "top_p": 1, "n": 1},
    ],
)
async def test_vllm_accepts(
    pod: SimPod, http: aiohttp.ClientSession, fields: dict[str, Any]
) -> None:
    body = {"prompt": "x", "max_tokens": 2} | fields
    async with http.post(pod.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()


async def test_max_tokens_beyond_the_context_is_clamped(
    make_pod: MakePod, http: aiohttp.ClientSession
) -> None:
    pod = await make_pod(max_model_len=300)
    body = {"prompt": "x" * 40, "max_tokens": 295, "ignore_eos": True}  # 10 prompt tokens: 290 fit
    async with http.post(pod.url + "/v1/completions", json=body) as resp:
        reply = await resp.json()
    assert reply["usage"]["completion_tokens"] == 290
    assert reply["choices"][0]["finish_reason"] == "length"
    body = {"prompt": "x" * 1200}  # exactly the context: no room for one output token
    async with http.post(pod.url + "/v1/completions", json=body) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == "max_tokens"


async def test_sdk_raises_its_own_error_classes(pod: SimPod) -> None:
    async with client(pod) as sdk:
        with pytest.raises(openai.NotFoundError):
            await sdk.completions.create(model="nope", prompt="x")
        with pytest.raises(openai.BadRequestError, match="maximum context length"):
            await sdk.completions.create(model=MODEL, prompt="x" * 600_000)
        with pytest.raises(openai.BadRequestError, match="cannot be greater than max_model_len"):
            await sdk.completions.create(model=MODEL, prompt="x", max_tokens=10**6)


VLLM_NAMES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:cache_config_info": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:num_requests_waiting_by_reason": "gauge",
    "vllm:request_success": "counter",
    "vllm:prompt_tokens_cached": "counter",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:iteration_tokens_total": "histogram",
}


async def test_metrics_carry_vllm_names_and_labels(
    pod: SimPod, http: aiohttp.ClientSession
) -> None:
    async with client(pod) as sdk:
        await sdk.completions.create(model=MODEL, prompt="count me", max_tokens=4)
    async with http.get(pod.url + "/metrics") as resp:
        assert resp.headers["content-type"] == "text/plain; version=1.0.0; charset=utf-8"
        text = await resp.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert {name: families[name].type for name in VLLM_NAMES} == VLLM_NAMES
    for line in ("vllm:prompt_tokens_total{", "vllm:generation_tokens_total{"):
        assert line in text
    assert "_created" not in text
    samples = {s.name: s for f in families.values() for s in f.samples}
    gen = samples["vllm:generation_tokens_total"]
    assert gen.labels == {"model_name": MODEL, "engine": "0"} and gen.value == 4
    info = samples["vllm:cache_config_info"].labels
    assert info["block_size"] == "16" and info["num_gpu_blocks"] == "28000"
    assert info["gpu_memory_utilization"] == "0.92" and info["engine"] == "0"
    assert "model_name" not in info
    success = {
        s.labels["finished_reason"]: s.value
        for s in families["vllm:request_success"].samples
        if s.name.endswith("_total")
    }
    assert success == {"stop": 0, "length": 1, "abort": 0, "error": 0, "repetition": 0}
    waiting = {s.labels["reason"]: s.value for s in families[
        "vllm:num_requests_waiting_by_reason"].samples}  # fmt: skip
    assert waiting == {"capacity": 0, "deferred": 0}
    assert samples["vllm:request_queue_time_seconds_count"].value == 1
    assert samples["vllm:request_decode_time_seconds_count"].value == 1
    assert samples["vllm:time_to_first_token_seconds_count"].value == 1
    assert samples["vllm:inter_token_latency_seconds_count"].value == 3
    assert samples["vllm:e2e_request_latency_seconds_count"].value == 1


async def test_large_bodies_are_read_like_vllm_reads_them(pod: SimPod) -> None:
    """vLLM sets no body size limit (the gateway does): a 3 MiB prompt gets vLLM's own answer,
    here the context-length 400, never a plain-text 413."""
    async with client(pod) as sdk:
        with pytest.raises(openai.BadRequestError) as refused:
            await sdk.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "ab " * (1 << 20)}]
            )
    assert "maximum context length" in refused.value.message


async def test_cache_salt_separates_prefix_caches(pod: SimPod) -> None:
    prompt: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "a long shared prompt " * 200}
    ]
    async with client(pod) as sdk:
        for salt in ("one", "one", "two"):
            await sdk.chat.completions.create(
                model=MODEL, messages=prompt, max_tokens=1, extra_body={"cache_salt": salt}
            )
    cached = pod.engine.stats.prompt_tokens_cached
    assert cached > 0  # the second request hit the first one's blocks; the third hit nothing
    async with client(pod) as sdk:
        await sdk.chat.completions.create(
            model=MODEL, messages=prompt, max_tokens=1, extra_body={"cache_salt": "three"}
        )
    assert pod.engine.stats.prompt_tokens_cached == cached
