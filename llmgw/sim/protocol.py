"""The OpenAI wire format as vLLM speaks it: request validation, bodies, SSE chunks, errors."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any, Literal

from llmgw.sim.tokens import count_tokens, natural_length, render_chat
from llmgw.sim.types import FinishReason, Job, SimSettings

Kind = Literal["chat", "completion"]
DONE = b"data: [DONE]\n\n"


class ApiError(Exception):
    """An error reply in vLLM's shape."""

    def __init__(self, status: int, message: str, type_: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_

    def body(self) -> dict[str, Any]:
        return {
            "object": "error",
            "message": self.message,
            "type": self.type,
            "param": None,
            "code": self.status,
        }


@dataclass(frozen=True, slots=True)
class Request:
    kind: Kind
    job: Job
    stream: bool
    include_usage: bool  # a usage chunk ends the stream


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _text(content: Any) -> str:
    """A message's content: a string, null, or a list of parts of which text parts count."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    raise ApiError(400, "message content must be a string or a list of content parts")


def _prompt(kind: Kind, body: dict[str, Any]) -> str:
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "`messages` must be a non-empty list")
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise ApiError(400, "each message needs a string `role`")
        return render_chat([(m["role"], _text(m.get("content"))) for m in messages])
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ApiError(400, "`prompt` must be a string (or a list of one string)")
    return prompt


def _number(body: dict[str, Any], name: str, low: float, high: float) -> None:
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ApiError(400, f"{name} must be a number in [{low}, {high}], got {value!r}.")


def _max_tokens(body: dict[str, Any]) -> int | None:
    value = body.get("max_completion_tokens")
    if value is None:
        value = body.get("max_tokens")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {value!r}.")
    return value


def parse(kind: Kind, body: Any, settings: SimSettings) -> Request:
    """Validate a request body into what the engine needs, or raise ApiError."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != settings.model:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError")
    prompt = _prompt(kind, body)
    if body.get("n", 1) != 1:
        raise ApiError(400, "only n=1 is supported")
    _number(body, "temperature", 0.0, 2.0)
    _number(body, "top_p", 1e-9, 1.0)
    stream = body.get("stream") is True
    options = body.get("stream_options")
    if options is not None and not stream:
        raise ApiError(400, "Stream options can only be defined when `stream=True`.")
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    max_tokens = _max_tokens(body)
    prompt_tokens = count_tokens(prompt)
    limit = settings.max_model_len
    if prompt_tokens >= limit:
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens. However, your request has "
            f"{prompt_tokens} input tokens. Please reduce the length of the input messages.",
        )
    if max_tokens is not None and prompt_tokens + max_tokens > limit:
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or "
            "completion.",
        )
    # max_tokens is always generated in full, so that load tests know their token counts;
    # without it the 'model' stops at its own length, or, with ignore_eos, at the context limit.
    room = limit - prompt_tokens
    natural = natural_length(settings.seed, prompt)
    reason: FinishReason = "stop"
    output = natural
    if max_tokens is not None:
        output, reason = max_tokens, "length"
    elif body.get("ignore_eos") is True or natural >= room:
        output, reason = room, "length"
    return Request(
        kind=kind,
        job=Job(prompt, prompt_tokens, output, reason),
        stream=stream,
        include_usage=include_usage or settings.force_include_usage,
    )


def usage(job: Job, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": job.prompt_tokens,
        "total_tokens": job.prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


class Reply:
    """The bodies of one response: a whole JSON reply, or its SSE chunks one token each."""

    def __init__(self, request: Request, model: str) -> None:
        self.request = request
        self.chat = chat = request.kind == "chat"
        self.id = ("chatcmpl-" if chat else "cmpl-") + os.urandom(16).hex()
        self.created = int(time.time())
        self.model = model
        head: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if chat else "text_completion",
        }
        head |= {"created": self.created, "model": model}
        self._head = "data: " + dumps(head)[:-1]
        field = '"delta":{"content":' if chat else '"text":'
        self._open = self._head + ',"choices":[{"index":0,' + field
        self._close = ("}" if chat else "") + ',"logprobs":null,"finish_reason":'

    def whole(self, tokens: list[str], finish: FinishReason) -> dict[str, Any]:
        text = "".join(tokens)
        choice: dict[str, Any] = {"index": 0}
        if self.request.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
        else:
            choice["text"] = text
        choice |= {"logprobs": None, "finish_reason": finish, "stop_reason": None}
        return {
            "id": self.id,
            "object": "chat.completion" if self.request.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage(self.request.job, len(tokens)),
            "system_fingerprint": None,
        }

    def role(self) -> bytes:
        """The first chat chunk, as vLLM sends it: the role and empty content."""
        choice = '"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null'
        return (self._head + ',"choices":[{"index":0,' + choice + "}]}\n\n").encode()

    def token(self, text: str, finish: FinishReason | None) -> bytes:
        return (self._open + dumps(text) + self._close + dumps(finish) + "}]}\n\n").encode()

    def usage_chunk(self, completion_tokens: int) -> bytes:
        body = ',"choices":[],"usage":' + dumps(usage(self.request.job, completion_tokens))
        return (self._head + body + "}\n\n").encode()
