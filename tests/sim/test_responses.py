"""The Responses API (`POST /v1/responses`) as vLLM 0.32 serves a plain text model: the Response
object, its event stream, the conversation it renders, its errors, the OpenAI SDK reading both."""

from __future__ import annotations

import json
import re
from typing import Any

import aiohttp
import openai
import pytest

from sim import SimPod, SimSettings
from sim.__main__ import STORE_ENV, settings_from
from sim.responses import parse
from sim.store import ResponseStore
from sim.tokens import CHARS_PER_TOKEN, natural_length, render_chat
from tests.sim.conftest import MakePod, drained

pytestmark = pytest.mark.timeout(30)

RESPONSES = "/v1/responses"
# ResponsesResponse's fields in vLLM's order (model_dump: every one, `metrics` left out).
FIELDS = [
    "id", "created_at", "incomplete_details", "instructions", "metadata", "model", "object",
    "output", "parallel_tool_calls", "temperature", "tool_choice", "tools", "top_p", "background",
    "max_output_tokens", "max_tool_calls", "previous_response_id", "prompt", "reasoning",
    "service_tier", "status", "text", "top_logprobs", "truncation", "usage", "user",
    "presence_penalty", "frequency_penalty", "kv_transfer_params", "ec_transfer_params",
    "input_messages", "output_messages",
]  # fmt: skip
STREAMED = [
    "response.created", "response.in_progress", "response.output_item.added",
    "response.content_part.added",
]  # fmt: skip
CLOSING = [
    "response.output_text.done", "response.content_part.done", "response.output_item.done",
    "response.completed",
]  # fmt: skip


async def respond(
    http: aiohttp.ClientSession,
    pod: SimPod,
    body: Any,
    status: int = 200,
    headers: dict[str, str] | None = None,
) -> Any:
    async with http.post(pod.url + RESPONSES, json=body, headers=headers) as resp:
        assert resp.status == status, await resp.text()
        assert resp.headers["Content-Type"] == "application/json"
        return await resp.json()


async def stream(http: aiohttp.ClientSession, pod: SimPod, body: Any) -> list[dict[str, Any]]:
    """The stream's events, its framing checked: `event: <type>` then `data: <json>`, a blank
    line after each, no `[DONE]`."""
    async with http.post(pod.url + RESPONSES, json=body | {"stream": True}) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
        frames = (await resp.text()).split("\n\n")
    assert frames[-1] == ""
    events = []
    for frame in frames[:-1]:
        kind, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == "event: " + event["type"]
        events.append(event)
    return events


async def test_a_whole_response_has_vllms_fields_and_the_engines_counts(
    pod: SimPod, http: aiohttp.ClientSession
) -> None:
    reply = await respond(http, pod, {"input": "hi", "max_output_tokens": 7, "ignore_eos": True})
    assert list(reply) == FIELDS
    assert re.fullmatch(r"resp_[0-9a-f]{16}", reply["id"]) and reply["object"] == "response"
    assert reply["model"] == pod.settings.model and reply["status"] == "incomplete"
    assert reply["incomplete_details"] == {"reason": "max_output_tokens"}
    assert (reply["temperature"], reply["top_p"], reply["tool_choice"]) == (1.0, 1.0, "none")
    assert reply["max_output_tokens"] == 7 and reply["truncation"] == "disabled"
    (message,) = reply["output"]
    assert list(message) == ["id", "content", "role", "status", "type", "phase"]
    assert re.fullmatch(r"msg_[0-9a-f]{16}", message["id"]) and message["status"] == "completed"
    (part,) = message["content"]
    assert part == {
        "annotations": [],
        "text": part["text"],
        "type": "output_text",
        "logprobs": None,
    }
    assert len(part["text"].split()) == 7
    usage = reply["usage"]
    assert usage["output_tokens"] == 7 == pod.stats.generation_tokens
    assert usage["input_tokens"] == pod.stats.prompt_tokens
    assert usage["total_tokens"] == usage["input_tokens"] + 7
    blocks = usage["input_tokens"] // 16 * 16  # the prompt's full blocks: written to the cache
    assert usage["input_tokens_details"] == {
        "cached_tokens": 0, "cache_write_tokens": blocks, "input_tokens_per_turn": [],
        "cached_tokens_per_turn": []}  # fmt: skip
    assert usage["output_tokens_details"] == {
        "reasoning_tokens": 0, "tool_output_tokens": 0, "output_tokens_per_turn": [],
        "tool_output_tokens_per_turn": []}  # fmt: skip


async def test_an_answer_that_ends_is_completed_its_eos_counted(
    pod: SimPod, http: aiohttp.ClientSession
) -> None:
    reply = await respond(http, pod, {"input": "tell me"})
    assert reply["status"] == "completed" and reply["incomplete_details"] is None
    # Without max_output_tokens the cap is the room beside the prompt, as vLLM reports it.
    prompt = reply["usage"]["input_tokens"]
    assert reply["max_output_tokens"] == pod.settings.max_model_len - prompt
    natural = natural_length(pod.settings.seed, render_chat([("user", "tell me")]))
    assert reply["usage"]["output_tokens"] == natural == pod.stats.generation_tokens
    assert len(reply["output"][0]["content"][0]["text"].split()) == natural - 1  # the EOS: no text


async def test_instructions_and_items_render_as_the_chat_conversation(
    pod: SimPod, http: aiohttp.ClientSession
) -> None:
    """The same prompt (count, prefix-cache blocks) as the chat request vLLM renders it into."""
    q1, a1, q2 = "Q1 " * 40, "A1 " * 40, "Q2 " * 40
    conversation = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": q1}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": a1}]},
        {"role": "user", "content": q2},
    ]
    body = {"instructions": "be brief", "input": conversation, "max_output_tokens": 2}
    reply = await respond(http, pod, body)
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": q1},
        {"role": "assistant", "content": a1},
        {"role": "user", "content": q2},
    ]
    async with http.post(pod.url + "/v1/chat/completions", json={"messages": messages}) as resp:
        as_chat = await resp.json()
    assert reply["usage"]["input_tokens"] == as_chat["usage"]["prompt_tokens"]
    assert pod.stats.prefix_hits == as_chat["usage"]["prompt_tokens"] // 16 * 16  # one prompt
    assert reply["instructions"] == "be brief"


async def test_a_repeated_prompt_reports_its_cached_tokens(
    pod: SimPod, http: aiohttp.ClientSession
) -> None:
    body = {"input": "x" * 40 * CHARS_PER_TOKEN, "max_output_tokens": 2}
    first = (await respond(http, pod, body))["usage"]
    second = (await respond(http, pod, body))["usage"]
    blocks = first["input_tokens"] // 16 * 16
    assert first["input_tokens_details"]["cache_write_tokens"] == blocks
    assert first["input_tokens_details"]["cached_tokens"] == 0
    assert second["input_tokens_details"]["cached_tokens"] == blocks
    assert second["input_tokens_details"]["cache_write_tokens"] == 0
    assert pod.stats.prompt_tokens_cached == blocks


async def test_the_stream_sends_vllms_events_in_order(
    pod: SimPod, http: aiohttp.ClientSession
) -> None:
    events = await stream(http, pod, {"input": "hi", "max_output_tokens": 5, "ignore_eos": True})
    kinds = [e["type"] for e in events]
    assert kinds == [*STREAMED, *["response.output_text.delta"] * 5, *CLOSING]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    created, progress, added, part, *deltas, text, part_done, item_done, completed = events
    assert created["response"] == progress["response"]
    assert created["response"]["status"] == "in_progress" and created["response"]["output"] == []
    assert created["response"]["usage"] is None and list(created["response"]) == FIELDS
    item = added["item"]["id"]
    assert added["item"] == {"id": item, "content": [], "role": "assistant",
                             "status": "in_progress", "type": "message", "phase": None}  # fmt: skip
    assert list(part) == ["content_index", "item_id", "output_index", "part", "sequence_number",
                          "type"]  # fmt: skip
    assert part["part"] == {"annotations": [], "text": "", "type": "output_text", "logprobs": []}
    assert list(deltas[0]) == ["content_index", "delta", "item_id", "logprobs", "output_index",
                               "sequence_number", "type"]  # fmt: skip
    whole = "".join(d["delta"] for d in deltas)
    assert text["text"] == whole and text["logprobs"] == [] and "sequence_number" in text
    assert part_done["part"] == {"annotations": [], "text": whole, "type": "output_text",
                                 "logprobs": None}  # fmt: skip
    assert item_done["item"]["content"] == [part_done["part"]]
    final = completed["response"]
    assert final["id"] == created["response"]["id"] and final["output"] == [item_done["item"]]
    assert final["status"] == "incomplete"
    assert final["usage"]["output_tokens"] == 5 == pod.stats.generation_tokens
    assert final["usage"]["input_tokens"] == pod.stats.prompt_tokens


async def test_a_stream_that_ends_sends_no_delta_for_the_eos(
    pod: SimPod, http: aiohttp.ClientSession
) -> None:
    events = await stream(http, pod, {"input": "tell me"})
    final = events[-1]["response"]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert final["status"] == "completed"
    assert len(deltas) == final["usage"]["output_tokens"] - 1


async def test_the_body_request_id_names_the_response_and_the_header_priority_counts(
    pod: SimPod, http: aiohttp.ClientSession
) -> None:
    body = {"input": "hi", "max_output_tokens": 2, "request_id": "from-body"}
    reply = await respond(http, pod, body, headers={"X-Request-Id": "from-envoy"})
    assert reply["id"] == "from-body"
    body.pop("request_id")
    reply = await respond(http, pod, body, headers={"X-Request-Id": "from-envoy"})
    assert re.fullmatch(r"resp_[0-9a-f]{16}", reply["id"])
    settings = SimSettings()
    store = ResponseStore.of(settings)
    assert parse({"input": "x", "priority": 3}, settings, None, store).job.priority == 3
    assert parse({"input": "x", "priority": 3}, settings, "-2", store).job.priority == -2
    assert parse({"input": "x", "priority": 3}, settings, "high", store).job.priority == 3


async def test_the_openai_sdk_reads_both_replies(pod: SimPod) -> None:
    async with openai.AsyncOpenAI(base_url=pod.url + "/v1", api_key="x", max_retries=0) as sdk:
        whole = await sdk.responses.create(
            model=pod.settings.model, input="hi", instructions="be brief", max_output_tokens=4
        )
        assert whole.status == "incomplete" and whole.usage is not None
        assert whole.usage.output_tokens == 4 and whole.output_text
        events = [
            e
            async for e in await sdk.responses.create(
                model=pod.settings.model, input="hi", max_output_tokens=3, stream=True
            )
        ]
    assert [e.type for e in events[:2]] == STREAMED[:2]
    completed = events[-1]
    assert completed.type == "response.completed" and completed.response.usage is not None
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert completed.response.output_text == deltas
    assert completed.response.usage.output_tokens == 3


async def test_a_client_that_hangs_up_mid_stream_aborts_the_request(
    make_pod: MakePod, http: aiohttp.ClientSession
) -> None:
    pod = await make_pod(time_scale=1.0)  # real H100 pace: 200 tokens take ~1.3 s
    body = {"input": "long answer", "max_output_tokens": 200, "ignore_eos": True, "stream": True}
    async with http.post(pod.url + RESPONSES, json=body) as resp:
        while b"response.output_text.delta" not in await resp.content.readuntil(b"\n\n"):
            pass
        assert pod.engine.gauges()[0] == 1
        resp.close()
    assert await drained(pod)
    assert pod.stats.generation_tokens < 200 and pod.stats.success["abort"] == 1


async def test_a_failure_during_generation_cuts_the_stream(
    pod: SimPod, http: aiohttp.ClientSession
) -> None:
    async with http.put(pod.url + "/admin/faults", json={"error_mid_stream": 1}) as resp:
        assert resp.status == 200
    body = {"input": "hi", "max_output_tokens": 50, "ignore_eos": True, "stream": True}
    async with http.post(pod.url + RESPONSES, json=body) as resp:
        assert resp.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()
    assert await drained(pod)
    await respond(http, pod, body | {"stream": False}, 500)


def _fill(limit: int) -> str:
    """User content whose rendered prompt is exactly `limit` tokens (4 characters a token)."""
    overhead = len(render_chat([("user", "")]))
    return "x" * (limit * CHARS_PER_TOKEN - overhead)


# name -> (body, status, the error's type, its param, the start of its message)
ERRORS: dict[str, tuple[dict[str, Any], int, str, str | None, str]] = {
    "no input": ({"input": None}, 400, "Bad Request", "body.input", "1 validation error:"),
    "unknown model": ({"model": "nope"}, 404, "NotFoundError", "model", "The model `nope`"),
    "background": ({"background": True}, 400, "invalid_request_error", "background",
                   "This vLLM engine does not support `store=True`"),
    "background without store": ({"background": True, "store": False}, 400, "BadRequestError",
                                 "background", "background can only be used when `store` is true"),
    "previous response": ({"previous_response_id": "resp_1"}, 404, "invalid_request_error",
                          "response_id", "Response with id 'resp_1' not found."),
    "prompt template": ({"prompt": {"id": "p"}}, 400, "BadRequestError", "prompt",
                        "prompt template is not supported"),
    "tool_choice required": ({"tool_choice": "required"}, 400, "BadRequestError", "tool_choice",
                             "Tool choice 'required' must be specified"),
    "a role no item has": ({"input": [{"role": "tool", "content": "x"}]}, 400, "Bad Request",
                           "body.input", "2 validation errors:"),
    "an item that is no object": ({"input": ["hi"]}, 400, "Bad Request", "body.input",
                                  "2 validation errors:"),
    "a part of no known type": (
        {"input": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}, 400,
        "Bad Request", "body.input", "2 validation errors:"),
    "an item vLLM cannot render": ({"input": [{"type": "item_reference", "id": "x"}]}, 400,
                                   "BadRequestError", "input", "Unsupported input item type"),
    "encrypted reasoning": ({"input": [{"type": "reasoning", "summary": [],
                                        "encrypted_content": "e"}]}, 400, "BadRequestError",
                            "input", "Encrypted content is not supported."),
    "empty input": ({"input": []}, 400, "BadRequestError", None, "Cannot apply chat template"),
    "max_output_tokens over the context": ({"max_output_tokens": 2000}, 400, "BadRequestError",
                                           "max_output_tokens", "max_output_tokens=2000 cannot"),
    "max_output_tokens 0": ({"max_output_tokens": 0}, 400, "BadRequestError", "max_tokens",
                            "max_tokens must be at least 1, got 0."),
    "prompt over the context": ({"input": "x" * 8000}, 400, "BadRequestError", "input_tokens",
                                "This model's maximum context length is 1024 tokens."),
    "prompt filling the context": ({"input": _fill(1024)}, 400, "invalid_request_error", "input",
                                   "The engine prompt length 1024 exceeds the max_model_len 1024"),
    "bad temperature": ({"temperature": 3}, 400, "BadRequestError", "temperature",
                        "temperature must be in [0, 2]"),
    "priority not an integer": ({"priority": "high"}, 400, "Bad Request", "body.priority",
                                "1 validation error:"),
    "bad cache_salt": ({"cache_salt": ""}, 400, "BadRequestError", "cache_salt",
                       "Parameter 'cache_salt' must be a non-empty string"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(ERRORS))
async def test_errors_are_vllms(make_pod: MakePod, http: aiohttp.ClientSession, name: str) -> None:
    fields, status, kind, param, message = ERRORS[name]
    pod = await make_pod(max_model_len=1024)
    body = {k: v for k, v in ({"input": "hi"} | fields).items() if v is not None}
    error = (await respond(http, pod, body, status))["error"]
    assert (error["type"], error["param"], error["code"]) == (kind, param, status)
    assert error["message"].startswith(message), error["message"]
    assert pod.stats.prompt_tokens == 0 and await drained(pod)


async def test_store_is_accepted_and_extra_fields_ignored(
    pod: SimPod, http: aiohttp.ClientSession
) -> None:
    """vLLM turns `store` off without a word; fields it does not know (chat's `n`,
    `max_tokens`, `stream_options`) change nothing."""
    body = {"input": "hi", "store": True, "max_output_tokens": 3, "ignore_eos": True}
    extra = {"n": 2, "max_tokens": 9, "stream_options": {"include_usage": True}}
    reply = await respond(http, pod, body | extra | {"metadata": {"k": "v"}})
    assert reply["usage"]["output_tokens"] == 3 == pod.stats.generation_tokens
    assert reply["metadata"] == {"k": "v"} and "store" not in reply


# The response store (VLLM_ENABLE_RESPONSES_API_STORE=1).


async def stored_pod(make_pod: MakePod, **fields: Any) -> SimPod:
    return await make_pod(enable_responses_api_store=True, **fields)


async def retrieve(
    http: aiohttp.ClientSession, pod: SimPod, response_id: str, status: int = 200, query: str = ""
) -> Any:
    async with http.get(f"{pod.url}{RESPONSES}/{response_id}{query}") as resp:
        assert resp.status == status, await resp.text()
        assert resp.headers["Content-Type"] == "application/json"
        return await resp.json()


async def cancel(http: aiohttp.ClientSession, pod: SimPod, response_id: str, status: int) -> Any:
    async with http.post(f"{pod.url}{RESPONSES}/{response_id}/cancel") as resp:
        assert resp.status == status, await resp.text()
        return await resp.json()


def not_found(response_id: str) -> dict[str, Any]:
    """serving.py::_make_not_found_error's body."""
    message = f"Response with id '{response_id}' not found."
    error = {"message": message, "type": "invalid_request_error", "param": "response_id"}
    return {"error": error | {"code": 404}}


def output_text(reply: dict[str, Any]) -> str:
    (message,) = reply["output"]
    return "".join(part["text"] for part in message["content"])


async def prompt_tokens(
    http: aiohttp.ClientSession, pod: SimPod, messages: list[tuple[str, str]]
) -> int:
    """The prompt the same conversation makes as a chat request."""
    body = {"messages": [{"role": r, "content": c} for r, c in messages], "max_tokens": 1}
    async with http.post(pod.url + "/v1/chat/completions", json=body) as resp:
        return int((await resp.json())["usage"]["prompt_tokens"])


async def test_the_store_env_var_turns_it_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(STORE_ENV, raising=False)
    assert not settings_from([]).enable_responses_api_store
    for value, on in (("1", True), ("true", True), ("0", False)):
        monkeypatch.setenv(STORE_ENV, value)
        assert settings_from([]).enable_responses_api_store is on


async def test_a_stored_response_is_retrieved_as_it_was_sent(
    make_pod: MakePod, http: aiohttp.ClientSession
) -> None:
    pod = await stored_pod(make_pod)
    body = {"input": "hi", "max_output_tokens": 4, "metadata": {"k": "v"}}
    reply = await respond(http, pod, body)
    assert reply["previous_response_id"] is None and "store" not in reply  # no such field
    assert await retrieve(http, pod, reply["id"]) == reply
    async with openai.AsyncOpenAI(base_url=pod.url + "/v1", api_key="x", max_retries=0) as sdk:
        read = await sdk.responses.retrieve(reply["id"])
    assert read.id == reply["id"] and read.output_text == output_text(reply)
    named = await respond(http, pod, body | {"request_id": "mine"})
    assert await retrieve(http, pod, "mine") == named


async def test_a_streamed_response_is_stored_as_its_completed_event_carries_it(
    make_pod: MakePod, http: aiohttp.ClientSession
) -> None:
    pod = await stored_pod(make_pod)
    events = await stream(http, pod, {"input": "hi", "max_output_tokens": 5, "ignore_eos": True})
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and final["status"] == "incomplete"
    assert await retrieve(http, pod, final["id"]) == final


async def test_previous_response_id_prepends_the_conversation(
    make_pod: MakePod, http: aiohttp.ClientSession
) -> None:
    """vLLM's construct_input_messages: the new instructions, the stored conversation less its
    system messages, the stored output as assistant messages, the new input; each turn's prompt
    is counted, scheduled and metered whole."""
    pod = await stored_pod(make_pod)
    q1, q2, q3 = "Q1 " * 40, "Q2 " * 30, "Q3 " * 20
    first = await respond(http, pod, {"instructions": "old rules", "input": q1,
                                      "max_output_tokens": 6, "ignore_eos": True})  # fmt: skip
    second = await respond(http, pod, {"input": q2, "previous_response_id": first["id"],
                                       "max_output_tokens": 6, "ignore_eos": True})  # fmt: skip
    assert second["previous_response_id"] == first["id"] and second["instructions"] is None
    a1, a2 = output_text(first), output_text(second)
    history = [("user", q1), ("assistant", a1), ("user", q2)]
    assert second["usage"]["input_tokens"] == await prompt_tokens(http, pod, history)
    alone = await prompt_tokens(http, pod, [("user", q2)])
    assert second["usage"]["input_tokens"] > alone + len(q1 + a1) // CHARS_PER_TOKEN
    # A chain: the second turn's stored conversation already holds the first.
    metered = pod.stats.prompt_tokens
    third = await respond(http, pod, {"instructions": "new rules", "input": q3,
                                      "previous_response_id": second["id"],
                                      "max_output_tokens": 2})  # fmt: skip
    chain = [("system", "new rules"), *history, ("assistant", a2), ("user", q3)]
    assert third["usage"]["input_tokens"] == await prompt_tokens(http, pod, chain)
    assert pod.stats.prompt_tokens - metered == 2 * third["usage"]["input_tokens"]


async def test_unknown_and_unstored_responses_are_vllms_404(
    make_pod: MakePod, http: aiohttp.ClientSession
) -> None:
    pod = await stored_pod(make_pod)
    body = {"input": "hi", "previous_response_id": "resp_nope"}
    assert await respond(http, pod, body, 404) == not_found("resp_nope")
    assert await retrieve(http, pod, "resp_nope", 404) == not_found("resp_nope")
    unkept = await respond(http, pod, {"input": "hi", "max_output_tokens": 2, "store": False})
    assert await retrieve(http, pod, unkept["id"], 404) == not_found(unkept["id"])
    body["previous_response_id"] = unkept["id"]
    assert await respond(http, pod, body, 404) == not_found(unkept["id"])


async def test_a_response_that_failed_is_not_kept(
    make_pod: MakePod, http: aiohttp.ClientSession
) -> None:
    pod = await stored_pod(make_pod)
    async with http.put(pod.url + "/admin/faults", json={"error_mid_stream": 1}) as resp:
        assert resp.status == 200
    body = {"input": "hi", "max_output_tokens": 2, "request_id": "failed"}
    await respond(http, pod, body, 500)
    assert await retrieve(http, pod, "failed", 404) == not_found("failed")


async def test_cancel_answers_404_or_that_a_synchronous_response_cannot_be(
    make_pod: MakePod, http: aiohttp.ClientSession
) -> None:
    pod = await stored_pod(make_pod)
    assert await cancel(http, pod, "resp_nope", 404) == not_found("resp_nope")
    reply = await respond(http, pod, {"input": "hi", "max_output_tokens": 2})
    error = {"message": "Cannot cancel a synchronous response.",
             "type": "invalid_request_error", "param": "response_id", "code": 400}  # fmt: skip
    assert await cancel(http, pod, reply["id"], 400) == {"error": error}
    assert await retrieve(http, pod, reply["id"]) == reply  # unchanged


async def test_retrieving_a_foreground_response_as_a_stream_cuts_it(
    make_pod: MakePod, http: aiohttp.ClientSession
) -> None:
    """vLLM has no events of a response that ran in the foreground: the 200 goes out, then the
    connection closes. Its query parameters are validated first, as FastAPI does."""
    pod = await stored_pod(make_pod)
    reply = await respond(http, pod, {"input": "hi", "max_output_tokens": 2})
    url = f"{pod.url}{RESPONSES}/{reply['id']}"
    async with http.get(url, params={"stream": "true", "starting_after": "0"}) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()
    error = (await retrieve(http, pod, reply["id"], 400, "?stream=maybe"))["error"]
    assert (error["type"], error["param"]) == ("Bad Request", "query.stream")
    assert error["message"].startswith("1 validation error:")
    assert await retrieve(http, pod, reply["id"], query="?stream=false&starting_after=3") == reply


async def test_background_stays_refused_with_the_store_on(
    make_pod: MakePod, http: aiohttp.ClientSession
) -> None:
    pod = await stored_pod(make_pod)
    error = (await respond(http, pod, {"input": "hi", "background": True}, 400))["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "background")
    assert error["message"].startswith("The simulator does not run background responses")
    assert pod.stats.prompt_tokens == 0


async def test_with_the_store_off_nothing_is_found(
    pod: SimPod, http: aiohttp.ClientSession
) -> None:
    """vLLM serves the routes with the store off; `store: true` is ignored, so every id is
    unknown."""
    reply = await respond(http, pod, {"input": "hi", "max_output_tokens": 2, "store": True})
    assert await retrieve(http, pod, reply["id"], 404) == not_found(reply["id"])
    assert await cancel(http, pod, reply["id"], 404) == not_found(reply["id"])
    body = {"input": "hi", "previous_response_id": reply["id"]}
    assert await respond(http, pod, body, 404) == not_found(reply["id"])


async def test_the_store_drops_its_oldest_response_past_its_bound(
    make_pod: MakePod, http: aiohttp.ClientSession
) -> None:
    """A difference from vLLM, which keeps every response until it stops."""
    pod = await stored_pod(make_pod, responses_api_store_max=2)
    ids = [
        (await respond(http, pod, {"input": "hi", "max_output_tokens": 1}))["id"] for _ in range(3)
    ]
    assert await retrieve(http, pod, ids[0], 404) == not_found(ids[0])
    for kept in ids[1:]:
        assert (await retrieve(http, pod, kept))["id"] == kept
