"""Request validation as vLLM 0.32 does it, into the jobs the engine runs.

The order is vLLM's: the request model's `mode="before"` validators (stream_options without
`stream`, an empty completion prompt, a bad `cache_salt`: 400 BadRequestError naming the
parameter), its fields (pydantic, so types coerce and fail the way FastAPI makes them:
`"priority": "3"` is 3, `"priority": "high"` a "Bad Request" naming `body.priority`), then the
model name (404), the output cap against the context, the rendered prompt against the context,
then SamplingParams. A `max_tokens` that does not fit beside the prompt is clamped to what does
(`serve/utils/api_utils.py::get_max_tokens`).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import jinja2
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llmgw import tokenizer
from llmgw.tokenizer import PromptCounter
from sim.errors import ApiError, from_pydantic, invalid, request_invalid
from sim.tokens import count_tokens, natural_length, render_chat
from sim.types import INT64_MAX, INT64_MIN, FinishReason, Job, SimSettings

Kind = Literal["chat", "completion"]
PRIORITY_HEADER = "X-Vllm-Priority"  # overrides the body's priority (generate/base/serving.py)
REQUEST_ID_HEADER = "X-Request-Id"  # names the reply before the body's request_id does
_SALT_FORBIDDEN = frozenset("@/\\\x00")
_SALT_MAX = 128


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


class StreamOptions(BaseModel):
    include_usage: bool | None = False  # vLLM's default: no usage unless asked (or forced)
    continuous_usage_stats: bool | None = False


class _Body(BaseModel):
    """The fields of vLLM's request models that the simulator reads; others are accepted."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    priority: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] = 0
    # vLLM: requests share prefix-cache blocks only with the same salt (checked before the
    # fields: _before_fields).
    cache_salt: str | None = None
    # The engine's request ID, named in the reply's `id` unless an X-Request-Id header names one.
    request_id: str | None = None


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatBody(_Body):
    messages: list[_Message]


class CompletionBody(_Body):
    prompt: (
        list[Annotated[int, Field(ge=0)]]
        | list[list[Annotated[int, Field(ge=0)]]]
        | str
        | list[str]
        | None
    ) = None


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str  # what the prefix cache hashes: chat-templated text, or token IDs spelled out
    tokens: int
    ids: tuple[int, ...] = ()  # the token IDs, with a tokenizer: what the blocks hash instead


@dataclass(frozen=True, slots=True)
class Request:
    kind: Kind
    prompts: list[Prompt]
    n: int
    jobs: list[Job]  # prompt-major: choice index i = prompt * n + sample, as vLLM numbers them
    stream: bool
    include_usage: bool  # a usage-only chunk ends the stream
    continuous_usage: bool  # usage on every chunk
    request_id: str | None = None  # the body's; an X-Request-Id header wins

    @property
    def prompt_tokens(self) -> int:
        return sum(p.tokens for p in self.prompts)


def _text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(str(part.get("text", "")) for part in content)


def _prompts(
    body: ChatBody | CompletionBody, limit: int, counter: PromptCounter | None
) -> list[Prompt]:
    """The rendered prompts. A text prompt is tokenized with truncation at `limit + 1` tokens
    (vLLM's get_encode_kwargs), so a longer one counts `limit + 1`; token IDs count in full.
    With the model's tokenizer (`counter`), text counts its tokens, else 4 characters a token;
    the text the engine hashes and seeds from is the simulator's rendering either way."""
    if isinstance(body, ChatBody):
        messages = [m.model_dump() for m in body.messages]
        return [chat_prompt(messages, (body.model_extra or {}).get("tools"), limit, counter)]
    raw = body.prompt
    if raw == []:
        raise invalid("You must pass at least one prompt")
    if isinstance(raw, str):
        return [_text_prompt(raw, limit, counter)]
    prompts: list[Prompt] = []
    ids: list[int] = []  # one prompt of token IDs
    for x in raw or ():
        if isinstance(x, int):
            ids.append(x)
        elif isinstance(x, str):
            prompts.append(_text_prompt(x, limit, counter))
        else:
            prompts.append(_ids(x))
    prompts = prompts or [_ids(ids)]
    if any(p.tokens == 0 for p in prompts):
        raise invalid("The decoder prompt cannot be empty")
    return prompts


def chat_prompt(
    messages: list[dict[str, Any]], tools: Any, limit: int, counter: PromptCounter | None
) -> Prompt:
    """A conversation through the chat template (`{"role", "content"}` messages), counted
    with truncation at `limit + 1` tokens as a text prompt is."""
    if not messages:
        raise invalid(
            "Cannot apply chat template to an empty conversation. Provide at least one message."
        )
    text = render_chat([(str(m["role"]), _text(m.get("content"))) for m in messages])
    if counter is None:
        return _text_prompt(text, limit)
    try:
        counted = counter.chat(messages, tools)
    except jinja2.TemplateError as exc:
        raise invalid(str(exc)) from exc
    return Prompt(text, min(counted.tokens, limit + 1), counted.ids)


def _text_prompt(text: str, limit: int, counter: PromptCounter | None = None) -> Prompt:
    if not text:
        return Prompt(text, 0)
    if counter is None:
        return Prompt(text, min(count_tokens(text), limit + 1))
    counted = counter.text(text)
    return Prompt(text, min(counted.tokens, limit + 1), counted.ids)


def _ids(ids: list[int]) -> Prompt:
    return Prompt(" ".join(map(str, ids)).ljust(4 * len(ids)), len(ids), tuple(ids))


def _before_fields(kind: Kind, body: dict[str, Any]) -> None:
    """vLLM's model_validator(mode="before") checks, in the order pydantic runs them (the last
    defined first). They raise VLLMValidationError, which pydantic does not wrap: 400
    BadRequestError naming the parameter, not a "Bad Request" validation error."""
    prompt = body.get("prompt")
    if kind == "completion" and (prompt is None or prompt == "") and not body.get("prompt_embeds"):
        raise invalid("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
    if body.get("stream_options") and not body.get("stream"):
        raise invalid("Stream options can only be defined when `stream=True`.", "stream_options")
    check_salt(body.get("cache_salt"))


def check_salt(salt: Any) -> None:
    """generate/base/protocol.py::validate_cache_salt, a `mode="before"` validator."""
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise invalid(
            "Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt"
        )
    if len(salt) > _SALT_MAX or any(c in _SALT_FORBIDDEN for c in salt):
        raise invalid(
            "Parameter 'cache_salt' must be at most 128 characters and must not contain "
            "'@', '/', '\\\\', or NUL.",
            "cache_salt",
        )


def check_object(body: Any) -> dict[str, Any]:
    """FastAPI's own check of the body, before the model's."""
    if not isinstance(body, dict):
        err = {
            "type": "model_attributes_type",
            "loc": ("body",),
            "msg": "Input should be a valid dictionary or object to extract fields from",
            "input": body,
        }
        raise request_invalid([err])
    return body


def _validated(kind: Kind, body: Any) -> ChatBody | CompletionBody:
    _before_fields(kind, check_object(body))
    try:
        if kind == "chat":
            return ChatBody.model_validate(body)
        return CompletionBody.model_validate(body)
    except ValidationError as exc:
        raise from_pydantic(exc) from None


def check_sampling(temperature: float | None, top_p: float | None, n: int | None = 1) -> None:
    """SamplingParams._verify_args, the checks a load test can reach (max_tokens: `job`)."""
    if n is not None and n < 1:
        raise invalid(f"n must be at least 1, got {n}.")
    t = temperature
    if t is not None and not 0.0 <= t <= 2.0:
        which = "non-negative" if t < 0 else "in [0, 2]"
        raise invalid(f"temperature must be {which}, got {t}.", "temperature", t)
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise invalid(f"top_p must be in (0, 1], got {top_p}.", "top_p", top_p)


def check_model(model: str | None, settings: SimSettings) -> None:
    """serve/engine/serving.py::_check_model: absent or empty names the served model."""
    if model and model != settings.model:
        raise ApiError(
            404,
            f"The model `{model}` does not exist. Valid aliases: {settings.model}.",
            "NotFoundError",
            "model",
        )


def check_cap(cap: int | None, param: str, limit: int) -> None:
    """renderers/params.py::TokenizeParams: an output cap above the context is refused."""
    if cap is not None and cap > limit:
        raise invalid(
            f"{param}={cap} cannot be greater than max_model_len={limit}. "
            "Please request fewer output tokens.",
            param,
            cap,
        )


def check_prompt(prompt: Prompt, limit: int) -> None:
    """renderers/params.py::_token_len_check (limit + 1 may be a truncated count)."""
    if prompt.tokens > limit:
        qualifier = "at least " if prompt.tokens == limit + 1 else ""
        raise invalid(
            f"This model's maximum context length is {limit} tokens. However, your prompt "
            f"contains {qualifier}{prompt.tokens} input tokens, which exceeds this limit "
            "even without any output tokens. Please reduce the length of the input prompt.",
            "input_tokens",
            prompt.tokens,
        )


def priority(body: int, header: str | None) -> int:
    """The X-Vllm-Priority header wins; vLLM ignores one it cannot read and keeps the body's."""
    if header is not None:
        with contextlib.suppress(ValueError):
            return int(header)
    return body


def parse(kind: Kind, raw: Any, settings: SimSettings, header_priority: str | None) -> Request:
    """Validate a request body into the engine's jobs, or raise ApiError."""
    body = _validated(kind, raw)
    check_model(body.model, settings)
    limit = settings.max_model_len
    cap, cap_param = body.max_completion_tokens, "max_completion_tokens"
    if cap is None:
        cap, cap_param = body.max_tokens, "max_tokens"
    check_cap(cap, cap_param, limit)
    prompts = _prompts(body, limit, prompt_counter(settings))
    for prompt in prompts:
        check_prompt(prompt, limit)
    check_sampling(body.temperature, body.top_p, body.n)
    rank = priority(body.priority, header_priority)
    n = body.n or 1
    jobs = [
        job(settings, prompt, sample, cap, body.ignore_eos, rank, body.cache_salt or "")
        for prompt in prompts
        for sample in range(n)
    ]
    options = body.stream_options
    include = bool(options and options.include_usage)
    continuous = include and bool(options and options.continuous_usage_stats)
    if settings.force_include_usage:
        # vLLM >= 0.20 returns (True, True) whatever the request says; 0.18 a final chunk.
        include, continuous = True, continuous or settings.usage_mode == "per-chunk"
    return Request(
        kind=kind,
        prompts=prompts,
        n=n,
        jobs=jobs,
        stream=body.stream is True,
        include_usage=include,
        continuous_usage=continuous,
        request_id=body.request_id,
    )


def prompt_counter(settings: SimSettings) -> PromptCounter | None:
    """The served model's tokenizer, where the pod has one."""
    return tokenizer.counter(settings.tokenizer) if settings.tokenizer else None


def room(settings: SimSettings, prompt: Prompt, cap: int | None) -> int:
    """The output cap: what fits beside the prompt, lowered to the request's cap
    (serve/utils/api_utils.py::get_max_tokens)."""
    left = settings.max_model_len - prompt.tokens
    return left if cap is None else min(cap, left)


def job(
    settings: SimSettings,
    prompt: Prompt,
    sample: int,
    cap: int | None,
    ignore_eos: bool,
    priority: int,
    cache_salt: str = "",
) -> Job:
    # A larger max_tokens is clamped to the room beside the prompt (0.32, 0.33), and a request
    # with no room at all fails SamplingParams' max_tokens >= 1.
    wanted = room(settings, prompt, cap)
    if wanted < 1:
        raise invalid(f"max_tokens must be at least 1, got {wanted}.", "max_tokens", wanted)
    # The 'model' stops (EOS) at its natural length unless ignore_eos or the cap comes first, as
    # vLLM does: the gateway names a cap on every request, which must not make every answer
    # run to it (load tests that need exact counts send ignore_eos).
    natural = natural_length(settings.seed, prompt.text, sample)
    reason: FinishReason = "stop"
    output = natural
    if ignore_eos or natural >= wanted:
        output, reason = wanted, "length"
    return Job(
        prompt.text,
        prompt.tokens,
        output,
        reason,
        sample=sample,
        priority=priority,
        cache_salt=cache_salt,
        prompt_ids=prompt.ids,
    )
