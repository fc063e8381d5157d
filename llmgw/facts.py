"""Request facts: the OpenAI body parsed once (by extauthz) into what everyone else needs.

extauthz publishes them as dynamic metadata in its namespace; Envoy's rate-limit descriptors, the
router (ext_proc `forwarding_namespaces`) and the access log (hence the ledger) read them from
there, so no other process parses the body and no two parse it differently.

The reservation is the prompt plus the output cap of every sequence, and that cap is the one the
pod receives (extauthz appends it to the body), so a client that names none is not reserved a
guess. The prompt is counted exactly where the operator names the model's tokenizer
(llmgw/tokenizer.py), else estimated (characters / 4). Beside it travels a bound the prompt
cannot exceed (`prompt_bound`), what a stream cut short before the pod reported usage is
charged: the exact count, or without a tokenizer the prompt's UTF-8 bytes (no byte-level
tokenizer makes more tokens than bytes; template markers and images as the estimate counts them).

Prefix blocks: the prompt rendered the way a chat template lays it out (role markers around each
message), cut into blocks of 16 "tokens" of ~4 characters; each block's hash covers every block
before it, so equal hashes mean equal prefixes. They travel as one hex string (16 characters a
block): protobuf Struct numbers are doubles, which cannot hold a 64-bit hash.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError

from llmgw import wire

BLOCK_TOKENS = 16
CHARS_PER_TOKEN = 4
BLOCK_CHARS = BLOCK_TOKENS * CHARS_PER_TOKEN
_HASH_HEX = 16
# No client number reaches Redis or a pod unclamped. An output cap beyond any model's context:
MAX_OUTPUT_TOKENS = 1 << 24
# vLLM refuses an `n` above VLLM_MAX_N_SEQUENCES (16384 by default), so this clamp never reserves
# less than a served request generates.
MAX_CHOICES = 16384
# What a chat template adds around each message and once for the assistant's header, in tokens:
# Llama 3's markers are ~5, the tiny test model's 5 (12 for the header), the simulator's (rendered
# as text) ~13; more here, so that neither the estimate nor the bound falls short for many short
# messages.
MESSAGE_TOKENS = 16
# What a tokenizer adds to a completion's text prompt (a BOS, at most an EOS too): in its bound.
PROMPT_SPECIAL_TOKENS = 2
# The reservation: above every limit (a request this large is refused, never admitted), exact as
# a double (metadata numbers are doubles) and far from overflowing Redis's 64-bit counters.
MAX_RESERVATION = 10**15
# What /v1/completions generates when the body has no `max_tokens` (vLLM's CompletionRequest
# default, OpenAI's too); an explicit null leaves it open, like chat's absent cap.
COMPLETIONS_DEFAULT_OUTPUT = 16

MetaValue = str | float | bool | Mapping[str, "MetaValue"]


@dataclass(frozen=True, slots=True)
class RequestFacts:
    model: str | None = None
    stream: bool = False
    include_usage: bool = False  # the client asked for the usage chunk (stream_options)
    n: int = 1  # sequences generated: max(n, best_of) for each prompt of the request
    max_output: int = 0  # output cap per sequence: the one the pod receives
    prompt_tokens: int = 0  # the tokenizer's count, else the estimate
    prompt_bound: int = 0  # the most tokens the prompt can be (0: unknown, the estimate's)
    prefix_blocks: tuple[int, ...] = ()
    # The pods' own hashes of the prompt's leading blocks of kv_block_size tokens, as their KV
    # events publish them (llmgw/kvblocks.py); none where the model has no tokenizer.
    kv_blocks: tuple[int, ...] = ()
    kv_block_size: int = 0
    first_turn: bool = False  # a known body with no assistant message: no pod has its KV yet
    # The most tokens the pod may put before the prompt unseen by the gateway (a stored
    # conversation the request continues): reserved and priced, never charged unless the pod
    # reports them (what a request that never reported is charged is its own prompt's).
    history: int = 0

    @property
    def prompt_ceiling(self) -> int:
        """What a prompt the pod never reported is charged: at least every tokenizer's count."""
        return max(self.prompt_bound, self.prompt_tokens)

    @property
    def token_estimate(self) -> int:
        """The reservation: history, prompt and every sequence's output cap."""
        return min(self.history + self.prompt_tokens + self.max_output * self.n, MAX_RESERVATION)

    def to_metadata(self) -> dict[str, MetaValue]:
        meta: dict[str, MetaValue] = {
            # A string: Envoy's rate-limit `metadata` action drops non-string values.
            wire.META_TOKEN_ESTIMATE: str(self.token_estimate),
            # What the admission reserves and prices before the output (a budget lowers the
            # cap to what is left beside it): the history too.
            wire.META_TOKEN_PROMPT: str(self.history + self.prompt_tokens),
            wire.META_TOKEN_CHOICES: str(self.n),
            wire.META_TOKEN_CEILING: str(self.history + self.prompt_ceiling),
            wire.META_PROMPT_ESTIMATE: float(self.prompt_tokens),
            wire.META_PROMPT_BOUND: float(self.prompt_bound),
            wire.META_STREAM: self.stream,
            wire.META_INCLUDE_USAGE: self.include_usage,
            wire.META_CHOICES: float(self.n),
            wire.META_MAX_OUTPUT: float(self.max_output),
            wire.META_FIRST_TURN: self.first_turn,
            # One format call for all blocks: a join of an f-string each costs twice as much.
            wire.META_PREFIX_BLOCKS: ("%016x" * len(self.prefix_blocks)) % self.prefix_blocks,
        }
        if self.kv_blocks:
            meta[wire.META_KV_BLOCKS] = ("%016x" * len(self.kv_blocks)) % self.kv_blocks
            meta[wire.META_KV_BLOCK_SIZE] = float(self.kv_block_size)
        if self.model is not None:
            meta[wire.META_MODEL] = self.model
        return meta

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> RequestFacts:
        """Tolerant: a missing or mistyped key takes its default (the router fails open)."""
        model = meta.get(wire.META_MODEL)
        blocks = meta.get(wire.META_PREFIX_BLOCKS)
        kv = meta.get(wire.META_KV_BLOCKS)
        kv_blocks = _blocks(kv) if isinstance(kv, str) else ()
        return cls(
            model=model if isinstance(model, str) and model else None,
            stream=meta.get(wire.META_STREAM) is True,
            include_usage=meta.get(wire.META_INCLUDE_USAGE) is True,
            n=_whole(meta.get(wire.META_CHOICES), 1),
            max_output=_whole(meta.get(wire.META_MAX_OUTPUT), 0),
            prompt_tokens=_whole(meta.get(wire.META_PROMPT_ESTIMATE), 0),
            prompt_bound=_whole(meta.get(wire.META_PROMPT_BOUND), 0),
            prefix_blocks=_blocks(blocks) if isinstance(blocks, str) else (),
            kv_blocks=kv_blocks,
            kv_block_size=_whole(meta.get(wire.META_KV_BLOCK_SIZE), 0) if kv_blocks else 0,
            first_turn=meta.get(wire.META_FIRST_TURN) is True,
        )


def from_body(
    request: Mapping[str, Any],
    *,
    chars_per_token: float,
    image_tokens: int,
    max_output: int,
    max_blocks: int,
    model: str | None,
    cache_group: str = "",
    prompt: PromptSize | None = None,
) -> RequestFacts:
    """Facts of a parsed JSON object body; `model` is the validated model name, if any;
    `max_output` the most output per sequence the gateway allows (`output_cap`); `prompt` the
    prompt's size if the caller has it (counted by the model's tokenizer), else estimated here.

    Values are read the way the pod reads them (vLLM validates with pydantic in lax mode:
    `"stream": "true"` streams, `"n": "3.0"` is 3), or a client could make the gateway believe
    something other than what the pod does.
    """
    stream = lax_bool(request.get("stream"))
    options = request.get("stream_options")
    include_usage = stream and isinstance(options, dict) and lax_bool(options.get("include_usage"))
    choices = max(_count(request.get("n")), _count(request.get("best_of")))
    size = prompt or prompt_size(request, chars_per_token, image_tokens)
    return RequestFacts(
        model=model,
        stream=stream,
        include_usage=include_usage,
        n=choices * _prompts(request.get("prompt")),
        max_output=output_cap(request, max_output),
        prompt_tokens=size.tokens,
        prompt_bound=size.ceiling,
        prefix_blocks=block_hashes(render(request), max_blocks, cache_group) if max_blocks else (),
        first_turn=is_first_turn(request),
    )


def output_cap(request: Mapping[str, Any], maximum: int) -> int:
    """The output cap per sequence the pod gets: the client's (`asked_output`), lowered to
    `maximum`, or `maximum` when the client leaves it open. `min(output_cap(r, a), b)` is
    `output_cap(r, min(a, b))`, so a bound known only later (the tenant's) lowers it alike."""
    asked = asked_output(request)
    return maximum if asked is None else min(asked, maximum)


def asked_output(request: Mapping[str, Any]) -> int | None:
    """The output cap the client names, as vLLM reads it: chat's `max_completion_tokens`, else
    `max_tokens`; a body without `messages` is a completion, whose absent `max_tokens` means 16.
    None: the client leaves it open, or names a value the pod would refuse (negative,
    fractional, not a number), which the gateway's cap replaces in the body."""
    if "messages" in request:
        asked = _lax_int(request.get("max_completion_tokens"))
        if asked is None or asked < 0:
            asked = _lax_int(request.get("max_tokens"))
    elif "max_tokens" in request:
        asked = _lax_int(request["max_tokens"])
    else:
        asked = COMPLETIONS_DEFAULT_OUTPUT
    return None if asked is None or asked < 0 else asked


@dataclass(frozen=True, slots=True)
class PromptSize:
    estimate: int  # characters / chars_per_token
    bound: int  # UTF-8 bytes: no byte-level tokenizer makes more tokens than bytes
    counted: int | None = None  # by the model's tokenizer, where it has one

    @property
    def tokens(self) -> int:
        """The count, else the estimate: what is reserved."""
        return self.estimate if self.counted is None else self.counted

    @property
    def ceiling(self) -> int:
        """The count, else the bound: the most the prompt can be."""
        return self.bound if self.counted is None else self.counted


def prompt_size(
    request: Mapping[str, Any], chars_per_token: float, image_tokens: int
) -> PromptSize:
    """The prompt's tokens without its tokenizer: text (characters / chars_per_token for the
    estimate, UTF-8 bytes for the bound, and PROMPT_SPECIAL_TOKENS a text prompt of a completion
    in it), plus MESSAGE_TOKENS a chat message (and once for the assistant's header); tool
    definitions, tool calls, documents and chat template arguments by the size of their JSON
    (the chat template renders them into the prompt); each content part without text (an image,
    audio, a file) as `image_tokens`; token-ID prompts by their length."""
    texts: list[str] = []
    tokens = 0
    specials = 0  # in the bound only: the estimate stays as it was
    messages = request.get("messages")
    if isinstance(messages, list):
        tokens += MESSAGE_TOKENS * (len(messages) + 1)
        for message in messages:
            if not isinstance(message, dict):
                continue
            # The role, a name, a tool_call_id: rendered into the prompt like the content.
            texts += [v for k, v in message.items() if k != "content" and isinstance(v, str)]
            content = message.get("content")
            if isinstance(content, str):
                texts.append(content)
            elif isinstance(content, list):
                for part in content:
                    text = part.get("text") if isinstance(part, dict) else None
                    if isinstance(text, str):
                        texts.append(text)
                    else:
                        tokens += image_tokens
            texts.append(_json(message.get("tool_calls")))
    # Rendered into the prompt by the chat template too (vLLM passes `documents`, and
    # `chat_template_kwargs` such as Llama 3.1's custom_tools, to it): their JSON's size.
    for name in ("tools", "functions", "documents", "chat_template_kwargs"):
        texts.append(_json(request.get(name)))
    for name in ("prompt", "input"):
        value = request.get(name)
        if isinstance(value, str):
            texts.append(value)
            specials += PROMPT_SPECIAL_TOKENS
        elif isinstance(value, list):
            for item in value:
                if isinstance(item, str):
                    texts.append(item)
                    specials += PROMPT_SPECIAL_TOKENS
                elif isinstance(item, int):
                    tokens += 1
                elif isinstance(item, list):  # a batch of token-ID prompts
                    tokens += sum(1 for t in item if isinstance(t, int))
    chars = sum(map(len, texts))
    # ASCII (most prompts) is one byte a character: no encoding needed to know.
    utf8 = sum(len(t) if t.isascii() else len(t.encode(errors="surrogatepass")) for t in texts)
    return PromptSize(math.ceil(chars / chars_per_token) + tokens, utf8 + tokens + specials)


def _json(value: object) -> str:
    return json.dumps(value) if isinstance(value, list | dict) and value else ""


def render(request: Mapping[str, Any]) -> str:
    """Chat messages as a template would render them; a completions `prompt` as is."""
    messages = request.get("messages")
    if isinstance(messages, list):
        return "".join(
            f"<|{msg.get('role', '')}|>\n{_text(msg.get('content'))}<|end|>\n"
            for msg in messages
            if isinstance(msg, dict)
        )
    prompt = request.get("prompt")
    return prompt if isinstance(prompt, str) else ""


def _text(content: object) -> str:
    """A message's text: a string, or its text parts joined (images and the like skipped)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return ""


def is_first_turn(request: Mapping[str, Any]) -> bool:
    """A chat request with no assistant message yet, or a completions request."""
    messages = request.get("messages")
    if not isinstance(messages, list):
        return True
    return not any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages)


# Copied for each block: a copy costs less than the constructor (and its keywords) every time.
_BLOCK_HASH = hashlib.blake2b(digest_size=8)


def block_hashes(text: str, max_blocks: int, cache_group: str = "") -> tuple[int, ...]:
    """Chained hashes of the leading full blocks. The cache group enters the first hash: pods
    share cached blocks only within a group (vLLM's cache_salt), so must the router's map."""
    data = text.encode()
    digests: list[bytes] = []
    prev = cache_group.encode()
    for start in range(0, min(len(data) // BLOCK_CHARS, max_blocks) * BLOCK_CHARS, BLOCK_CHARS):
        block = _BLOCK_HASH.copy()
        block.update(prev)
        block.update(data[start : start + BLOCK_CHARS])
        prev = block.digest()
        digests.append(prev)
    # Big-endian 64-bit integers, all in one call.
    return struct.unpack(f">{len(digests)}Q", b"".join(digests))


_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
# A number in a string is read by pydantic itself, as the pod (vLLM, pydantic's lax mode) reads
# it: its corners ("0__2" is 2, "0-3" is -3) are not worth copying. Past Python's 4,300 digits a
# string reads as more than any clamp (the reservation errs high, never low), and no caller's
# megabyte of digits reaches a parser whose cost grows with their square.
_PYDANTIC_INT: TypeAdapter[int] = TypeAdapter(int)
_INT_TEXT_CHARS = 4300
_BEYOND_EVERY_CLAMP = 10**15


def lax_bool(value: object) -> bool:
    """True where pydantic's lax bool is True (True, 1, "true", "yes", "on", …)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return value == 1
    return isinstance(value, str) and value.strip().lower() in _TRUE


def _lax_int(value: object) -> int | None:
    """An integer where pydantic's lax int reads one (2500, 2500.0, "2500", " 2_500.0 ", true),
    else None."""
    if isinstance(value, int):  # bool too: pydantic reads true as 1
        return int(value)
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    if isinstance(value, str):
        if len(value) > _INT_TEXT_CHARS:
            return _BEYOND_EVERY_CLAMP
        try:
            return _PYDANTIC_INT.validate_python(value)
        except ValidationError:
            return None
    return None


def _count(value: object) -> int:
    n = _lax_int(value)
    return min(n, MAX_CHOICES) if n is not None and n >= 1 else 1


def _prompts(prompt: object) -> int:
    """Completions answer each prompt of a list (of strings or of token-ID lists) on its own."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        return len(prompt)
    return 1


def _whole(value: object, default: int) -> int:
    if isinstance(value, float | int) and not isinstance(value, bool) and value >= 0:
        return int(value)
    return default


def _blocks(hexes: str) -> tuple[int, ...]:
    try:
        return tuple(
            int(hexes[i : i + _HASH_HEX], 16)
            for i in range(0, len(hexes) - _HASH_HEX + 1, _HASH_HEX)
        )
    except ValueError:
        return ()
