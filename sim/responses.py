"""The Responses API (`/v1/responses`) as vLLM 0.32 serves a plain text model: no harmony, no
reasoning or tool parser; the response store off (vLLM's default) or on
(`VLLM_ENABLE_RESPONSES_API_STORE=1`: sim/store.py).

A request (entrypoints/openai/responses/protocol.py::ResponsesRequest) becomes the conversation
vLLM renders it into (responses/utils.py::construct_input_messages: `instructions` a system
message; after a `previous_response_id`, that response's stored conversation less its system
messages and each text of its output as an assistant message; then the input's items as chat
messages), so it is counted, cached, scheduled and metered as a chat request is. The checks run
in vLLM's order: the model's `mode="before"` validators (the last defined first), its fields, the
model name, then serving.py's: `background` (400: with the store off there is nothing to run it
from; with it on vLLM runs it as a task, which the simulator does not: the gateway never sends
it), `previous_response_id` (404 unless stored: with the store off none ever is), the input
items, `max_output_tokens` against the context, the prompt against the context, SamplingParams.
`store: true`, the default, keeps the finished response when the store is on (the service does)
and is ignored when it is off.

The reply is the Response object with every field (`model_dump`), named by the body's
`request_id`, else `resp_` and 16 hex digits (the X-Request-Id header plays no part); "incomplete"
(`incomplete_details.reason: max_output_tokens`) when the output ran to its cap. A stream is SSE
with an `event:` line before each `data:` (api_router.py), numbered from 0, and no `[DONE]`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sim.chunks import random_id
from sim.engine import Sequence
from sim.errors import ApiError, from_pydantic, invalid, request_invalid
from sim.protocol import (
    Prompt,
    chat_prompt,
    check_cap,
    check_model,
    check_object,
    check_prompt,
    check_salt,
    check_sampling,
    dumps,
    job,
    priority,
    prompt_counter,
    room,
)
from sim.store import ResponseStore, Stored
from sim.types import INT64_MAX, INT64_MIN, Job, SimSettings

_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = frozenset({"input_text", "output_text", "refusal"})
_PARTS = _TEXT_PARTS | {"input_image", "input_file"}
# Items vLLM turns into chat messages other than messages (utils.py); any other type it parses
# is refused when rendered.
_CALLS = frozenset({"function_call", "custom_tool_call"})
_OUTPUTS = frozenset({"function_call_output", "custom_tool_call_output"})
_SAMPLING_EPS = 1e-5  # vllm/sampling_params.py: a lower temperature is greedy (top_p 1)
_LOGPROBS = "message.output_text.logprobs"


class ResponsesBody(BaseModel):
    """The fields of ResponsesRequest the simulator reads or echoes; others are accepted.
    `reasoning`, `text` and `tools` are echoed as sent (vLLM re-serialises them through the
    OpenAI SDK's models)."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    background: bool | None = False
    include: list[str] | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] | None = None
    model: str | None = None
    parallel_tool_calls: bool | None = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] = "auto"
    store: bool | None = True
    stream: bool | None = False
    temperature: float | None = None
    text: dict[str, Any] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_logprobs: int | None = 0
    top_p: float | None = None
    truncation: Literal["auto", "disabled"] | None = "disabled"
    user: str | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    request_id: str | None = None
    priority: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] = 0
    cache_salt: str | None = None
    ignore_eos: bool = False


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    body: ResponsesBody
    prompt: Prompt
    job: Job
    max_output_tokens: int  # as vLLM reports it: the cap lowered to what fits beside the prompt
    messages: list[dict[str, Any]]  # the rendered conversation: what the store keeps

    @property
    def stream(self) -> bool:
        return self.body.stream is True


def _before_fields(body: dict[str, Any]) -> None:
    """ResponsesRequest's `mode="before"` validators, the last defined first."""
    tools, choice = body.get("tools"), body.get("tool_choice", "auto")
    named = isinstance(choice, dict) and choice.get("type") in ("function", "custom")
    if not tools:
        if choice == "required":
            raise invalid(
                "Tool choice 'required' must be specified with 'tools' parameter.", "tool_choice"
            )
        if named:
            raise invalid("Tool choice 'function' not found in 'tools' parameter.", "tool_choice")
        if choice == "auto":
            body["tool_choice"] = "none"
    if body.get("prompt") is not None:
        raise invalid("prompt template is not supported", "prompt")
    if body.get("background") and not body.get("store", True):
        raise invalid("background can only be used when `store` is true", "background")
    check_salt(body.get("cache_salt"))


def _validated(raw: Any) -> ResponsesBody:
    body = dict(check_object(raw))
    _before_fields(body)
    try:
        parsed = ResponsesBody.model_validate(body)
    except ValidationError as exc:
        raise from_pydantic(exc) from None
    if isinstance(parsed.input, list):
        for i, item in enumerate(parsed.input):
            _check_item(i, item, parsed.input)
    return parsed


def _check_item(index: int, item: Any, given: list[Any]) -> None:
    """An item none of the SDK's input item types takes. pydantic reports every member of that
    union (over 200 errors); this reports the string branch and the message's."""
    if isinstance(item, dict) and item.get("type") not in (None, "message"):
        return  # another item type: refused when rendered unless it is a call or its output
    problem: tuple[str, tuple[Any, ...], str, Any] | None = None
    if not isinstance(item, dict):
        problem = ("model_type", (), "Input should be a valid dictionary", item)
    elif "role" not in item:
        problem = ("missing", ("role",), "Field required", item)
    elif item["role"] not in _ROLES:
        msg = "Input should be 'user', 'assistant', 'system' or 'developer'"
        problem = ("literal_error", ("role",), msg, item["role"])
    elif not isinstance(content := item.get("content"), str):
        parts = content if isinstance(content, list) else None
        bad = [p for p in parts or () if not isinstance(p, dict) or p.get("type") not in _PARTS]
        if parts is None:
            problem = ("string_type", ("content", "str"), "Input should be a valid string", content)
        elif bad:
            msg = "Input should be 'input_text'"
            problem = ("literal_error", ("content", parts.index(bad[0]), "type"), msg, bad[0])
    if problem is None:
        return
    kind, loc, msg, value = problem
    errors = [
        {"type": "string_type", "loc": ("body", "input", "str"),
         "msg": "Input should be a valid string", "input": given},
        {"type": kind, "loc": ("body", "input", index, "EasyInputMessageParam", *loc),
         "msg": msg, "input": value},
    ]  # fmt: skip
    raise request_invalid(errors, "body.input")


def _messages(body: ResponsesBody, previous: Stored | None) -> list[dict[str, Any]]:
    """utils.py::construct_input_messages: the instructions, the history, the input."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if previous is not None:
        messages += _history(previous)
    if isinstance(body.input, str):
        return [*messages, {"role": "user", "content": body.input}]
    return messages + _items(body.input)


def _history(previous: Stored) -> list[dict[str, Any]]:
    """A stored response's conversation less its system messages (instructions do not carry
    over), then each text part of its output messages as an assistant message."""
    kept = [m for m in previous.messages if m.get("role") != "system"]
    texts = [
        part["text"]
        for item in previous.response["output"]
        if item["type"] == "message"
        for part in item["content"]
    ]
    return kept + [{"role": "assistant", "content": text} for text in texts]


def _items(items: list[Any]) -> list[dict[str, Any]]:
    """utils.py::construct_chat_messages_with_tool_call: an item joins only an assistant
    message of the same input, never the history's."""
    messages: list[dict[str, Any]] = []
    for item in items:
        message = _message(item, messages[-1] if messages else None)
        if message is not None:
            messages.append(message)
    return messages


def _message(item: dict[str, Any], prev: dict[str, Any] | None) -> dict[str, Any] | None:
    """utils.py::_construct_message_from_response_item: one item as a chat message, or None
    where it joins the assistant message before it (tool calls, reasoning, content)."""
    assistant = prev if prev is not None and prev.get("role") == "assistant" else None
    kind = item.get("type")
    if kind in _CALLS:
        arguments = item.get("arguments")
        if kind == "custom_tool_call":
            arguments = json.dumps({"input": item.get("input") or ""}, ensure_ascii=False)
        call = {"name": item.get("name"), "arguments": arguments}
        tool_call = {"id": item.get("call_id"), "function": call, "type": "function"}
        if assistant is not None:
            assistant.setdefault("tool_calls", []).append(tool_call)
            return None
        return {"role": "assistant", "tool_calls": [tool_call]}
    if kind == "reasoning":
        if item.get("encrypted_content"):
            raise invalid("Encrypted content is not supported.", "input")
        texts = item.get("content") or item.get("summary") or [{}]
        return _join(assistant, "reasoning", str(texts[0].get("text", "")))
    if kind in _OUTPUTS:
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    if item.get("role") == "assistant" and isinstance(content := item.get("content"), list):
        if content:
            return _join(assistant, "content", content[0].get("text"))
    elif "role" in item:
        return item
    raise invalid(f"Unsupported input item type: {kind}", "input")


def _join(assistant: dict[str, Any] | None, key: str, text: str | None) -> dict[str, Any] | None:
    if assistant is not None and assistant.get(key) is None:
        assistant[key] = text
        return None
    return {"role": "assistant", key: text}


def _chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """utils.py::construct_tool_dicts: function tools in the chat form templates render."""
    functions = [
        {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
        for tool in tools
        if tool.get("type") == "function"
    ]
    return functions or None


def parse(
    raw: Any, settings: SimSettings, header_priority: str | None, store: ResponseStore
) -> ResponsesRequest:
    """Validate a Responses request into the engine's job, its history read from `store`, or
    raise ApiError."""
    body = _validated(raw)
    check_model(body.model, settings)
    if body.background:  # `store` is true here: a false one failed before the fields
        raise _no_background(settings.enable_responses_api_store)
    previous = None
    if body.previous_response_id is not None:
        previous = store.find(body.previous_response_id)
    messages = _messages(body, previous)
    limit = settings.max_model_len
    check_cap(body.max_output_tokens, "max_output_tokens", limit)
    prompt = chat_prompt(messages, _chat_tools(body.tools), limit, prompt_counter(settings))
    check_prompt(prompt, limit)
    if prompt.tokens >= limit:  # serving.py::_validate_generator_input: no room for output
        raise ApiError(
            400,
            f"The engine prompt length {prompt.tokens} exceeds the max_model_len {limit}. "
            "Please reduce prompt.",
            "invalid_request_error",
            "input",
        )
    check_sampling(body.temperature, body.top_p)
    rank = priority(body.priority, header_priority)
    cap = body.max_output_tokens
    work = job(settings, prompt, 0, cap, body.ignore_eos, rank, body.cache_salt or "")
    return ResponsesRequest(body, prompt, work, room(settings, prompt, cap), messages)


def _no_background(store_on: bool) -> ApiError:
    if store_on:  # the simulator's own refusal: vLLM would run the request as a task
        message = (
            "The simulator does not run background responses: send the request without "
            "`background`."
        )
    else:  # vLLM's
        message = (
            "This vLLM engine does not support `store=True` and therefore does not support the "
            "background mode. To enable these features, set the environment variable "
            "`VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server."
        )
    return ApiError(400, message, "invalid_request_error", "background")


class RetrieveQuery(BaseModel):
    """GET /v1/responses/{id}'s query parameters (api_router.py::retrieve_responses)."""

    starting_after: int | None = None
    stream: bool | None = False


def retrieve_query(pairs: Iterable[tuple[str, str]]) -> RetrieveQuery:
    """The parameters (the last of a repeated one, as Starlette reads them), or FastAPI's 400."""
    try:
        return RetrieveQuery.model_validate(dict(pairs))
    except ValidationError as exc:
        raise from_pydantic(exc, "query") from None


def cannot_cancel() -> ApiError:
    """serving.py::cancel_responses: only a queued or running (background) response can be
    cancelled; every one stored here ran in the foreground and finished."""
    message = "Cannot cancel a synchronous response."
    return ApiError(400, message, "invalid_request_error", "response_id")


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [_text_part(text, None)] if text else []
    return {
        "id": item_id,
        "content": content,
        "role": "assistant",
        "status": status,
        "type": "message",
        "phase": None,
    }


def _text_part(text: str, logprobs: list[Any] | None) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def usage(seq: Sequence) -> dict[str, Any]:
    """ResponseUsage as SimpleContext counts it: the prompt, its tokens found in the prefix cache
    and written to it, every output token (the EOS included)."""
    prompt, output = seq.job.prompt_tokens, len(seq.output)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": seq.cached,
            "cache_write_tokens": seq.cache_created,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": output,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": prompt + output,
    }


class ResponseReply:
    """The bodies of one response: the whole Response object, or its stream's events."""

    def __init__(self, request: ResponsesRequest, model: str) -> None:
        self.request = request
        self.model = model
        self.id = request.body.request_id or "resp_" + random_id()
        self.created = int(time.time())
        self.item = "msg_" + random_id()
        self.sequence = 0
        self.text = ""
        self.opened = False  # the message item is out: the first text opens it

    def response(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None
    ) -> dict[str, Any]:
        """protocol.py::ResponsesResponse.from_request, sampling values as SamplingParams has
        them (temperature 1 and top_p 1 by default; a greedy request's top_p is 1)."""
        body = self.request.body
        temperature = 1.0 if body.temperature is None else float(body.temperature)
        top_p = 1.0 if body.top_p is None or temperature < _SAMPLING_EPS else float(body.top_p)
        logprobs = body.top_logprobs if _LOGPROBS in (body.include or ()) else None
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "created_at": self.created,
            "incomplete_details": incomplete,
            "instructions": body.instructions,
            "metadata": body.metadata,
            "model": self.model,
            "object": "response",
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "temperature": temperature,
            "tool_choice": body.tool_choice,
            "tools": body.tools,
            "top_p": top_p,
            "background": body.background,
            "max_output_tokens": self.request.max_output_tokens,
            "max_tool_calls": body.max_tool_calls,
            "previous_response_id": body.previous_response_id,
            "prompt": None,
            "reasoning": body.reasoning,
            "service_tier": body.service_tier,
            "status": status,
            "text": body.text,
            "top_logprobs": logprobs,
            "truncation": body.truncation,
            "usage": usage,
            "user": body.user,
            "presence_penalty": float(body.presence_penalty or 0.0),
            "frequency_penalty": float(body.frequency_penalty or 0.0),
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "input_messages": None,
            "output_messages": None,
        }

    def whole(self, seq: Sequence) -> dict[str, Any]:
        """The non-streamed reply: one message, its content empty if the text is."""
        output = [_message_item(self.item, "".join(seq.output), "completed")]
        return self.response(_status(seq), output, usage(seq))

    def _event(self, kind: str, **fields: Any) -> bytes:
        # The SDK's event models declare their fields in alphabetical order.
        data = dict(sorted({**fields, "sequence_number": self.sequence, "type": kind}.items()))
        self.sequence += 1
        return f"event: {kind}\ndata: {dumps(data)}\n\n".encode()

    def opening(self) -> bytes:
        """response.created and response.in_progress, sent before the engine sees the request."""
        initial = self.response("in_progress", [], None)
        created = self._event("response.created", response=initial)
        return created + self._event("response.in_progress", response=initial)

    def token(self, text: str) -> bytes:
        """One token's events: none for an empty one (the EOS), the message opened by the first."""
        if not text:
            return b""
        events = b""
        if not self.opened:
            self.opened = True
            events += self._event(
                "response.output_item.added",
                output_index=0,
                item=_message_item(self.item, "", "in_progress"),
            )
            events += self._event(
                "response.content_part.added",
                output_index=0,
                item_id=self.item,
                content_index=0,
                part=_text_part("", []),
            )
        self.text += text
        return events + self._event(
            "response.output_text.delta",
            content_index=0,
            delta=text,
            item_id=self.item,
            logprobs=[],
            output_index=0,
        )

    def closing(self, seq: Sequence) -> tuple[bytes, dict[str, Any]]:
        """The message's done events (if it was opened), then response.completed carrying the
        usage, whatever the status; and that final Response object."""
        events = b""
        output: list[dict[str, Any]] = []
        if self.opened:
            ids = {"item_id": self.item, "output_index": 0, "content_index": 0}
            item = _message_item(self.item, self.text, "completed")
            events += self._event("response.output_text.done", text=self.text, logprobs=[], **ids)
            events += self._event("response.content_part.done", part=item["content"][0], **ids)
            events += self._event("response.output_item.done", output_index=0, item=item)
            output.append(item)
        final = self.response(_status(seq), output, usage(seq))
        return events + self._event("response.completed", response=final), final


def _status(seq: Sequence) -> str:
    return "incomplete" if seq.job.finish_reason == "length" else "completed"
