"""Response bodies byte for byte as vLLM 0.32 serialises them.

Streams: chunks are `model_dump_json(exclude_unset=True)`, so a field appears when vLLM's
code sets it, null or not: `prompt_token_ids`/`prompt_text` on the chat role chunk,
`token_ids` on every choice, `stop_reason` on a finishing choice, `system_fingerprint` on the
last chunk (the usage-only one when usage is included, else each finishing chunk). The
usage-only chunk drops nulls. Whole replies are `model_dump()`: every field, nulls included
(an empty `tool_calls` is removed). IDs are vLLM's: the request's ID (X-Request-Id, else the
body's `request_id`, else 16 random hex digits) after `chatcmpl-` or `cmpl-`.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

from sim.protocol import Request, dumps
from sim.types import FinishReason, SimSettings

VLLM_VERSION = "0.32.0"  # the release whose wire this simulator copies

DONE = b"data: [DONE]\n\n"
# A GenerationError after the 200 (json.dumps with its default separators, as vLLM does).
STREAM_ERROR = (
    b'data: {"error": {"message": "Internal server error", "type": "InternalServerError", '
    b'"param": null, "code": 500}}\n\n'
)


def random_id() -> str:
    """vLLM's random_uuid(): 64 random bits in 16 hex digits."""
    return os.urandom(8).hex()


def fingerprint(settings: SimSettings) -> str:
    """vLLM's default `system_fingerprint`: its version and 8 hex digits of a hash of its
    configuration (here the pod's settings)."""
    digest = hashlib.sha256(settings.model_dump_json(exclude={"api_key"}).encode()).hexdigest()
    return f"vllm-{VLLM_VERSION}-{digest[:8]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


class Reply:
    """The bodies of one response: a whole JSON reply, or its SSE chunks."""

    def __init__(
        self, request: Request, model: str, fingerprint: str, request_id: str | None = None
    ) -> None:
        self.request = request
        self.chat = chat = request.kind == "chat"
        self.id = ("chatcmpl-" if chat else "cmpl-") + (request_id or random_id())
        self.created = int(time.time())
        self.model = model
        self.fingerprint = fingerprint
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": self.id, "object": obj, "created": self.created, "model": model}
        self._head = "data: " + dumps(head)[:-1] + ',"choices":['

    def prompt_tokens(self, choice: int) -> int:
        """A choice's prompt: chat counts its one prompt, completions the choice's own."""
        return self.request.prompts[choice // self.request.n].tokens

    def _usage(self, choice: int, completion: int, chat_details: bool) -> str:
        if not self.request.continuous_usage:
            return ""
        body = dumps(usage(self.prompt_tokens(choice), completion))
        if chat_details:  # chat sets completion_tokens_details=None explicitly
            body = body[:-1] + ',"completion_tokens_details":null}'
        return ',"usage":' + body

    def role(self, choice: int) -> bytes:
        """The first chat chunk of a choice: the role and empty content."""
        return (
            self._head
            + f'{{"index":{choice},"delta":{{"role":"assistant","content":""}},'
            + '"logprobs":null,"finish_reason":null}]'
            + self._usage(choice, 0, True)
            + ',"prompt_token_ids":null,"prompt_text":null}\n\n'
        ).encode()

    def token(self, choice: int, text: str, finish: FinishReason | None, sent: int) -> bytes:
        """One token of a choice; `sent` counts its tokens so far, this one included."""
        if self.chat:
            body = f'{{"index":{choice},"delta":{{"content":{dumps(text)}}},"logprobs":null,'
        else:
            body = f'{{"index":{choice},"text":{dumps(text)},"logprobs":null,'
        if finish is None and self.chat:
            body += '"finish_reason":null,"token_ids":null}]'
        elif self.chat:
            body += f'"finish_reason":{dumps(finish)},"stop_reason":null,"token_ids":null}}]'
        else:
            body += (
                f'"finish_reason":{dumps(finish)},"stop_reason":null,"prompt_token_ids":null,'
                '"token_ids":null}]'
            )
        tail = self._usage(choice, sent, self.chat)
        if finish is not None and not self.request.include_usage:
            tail += ',"system_fingerprint":' + dumps(self.fingerprint)
        return (self._head + body + tail + "}\n\n").encode()

    def usage_chunk(self, completion_tokens: int) -> bytes:
        total = dumps(usage(self.request.prompt_tokens, completion_tokens))
        tail = f',"system_fingerprint":{dumps(self.fingerprint)}}}\n\n'
        return (self._head + '],"usage":' + total + tail).encode()

    def whole(self, outputs: list[list[str]], finishes: list[FinishReason]) -> dict[str, Any]:
        choices = []
        for i, (tokens, finish) in enumerate(zip(outputs, finishes, strict=True)):
            text = "".join(tokens)
            choice: dict[str, Any] = {"index": i}
            if self.chat:
                choice["message"] = {
                    "role": "assistant",
                    "content": text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "reasoning": None,
                }
                choice |= {"logprobs": None, "finish_reason": finish, "stop_reason": None}
                choice |= {"token_ids": None, "routed_experts": None}
            else:
                choice |= {"text": text, "logprobs": None, "finish_reason": finish}
                choice |= {"stop_reason": None, "token_ids": None, "prompt_logprobs": None}
                choice |= {"prompt_token_ids": None, "routed_experts": None}
            choices.append(choice)
        total = usage(self.request.prompt_tokens, sum(len(t) for t in outputs))
        reply: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": self.fingerprint,
            "usage": total | {"prompt_tokens_details": None, "completion_tokens_details": None},
        }
        if self.chat:
            reply |= {"prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None}
        reply |= {"kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}
        return reply
