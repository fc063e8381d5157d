"""A served model's prompt counted as its vLLM pod counts it: the model's `tokenizer.json` (the
`tokenizers` package), and its chat template beside it (`chat_template.jinja`, else
`tokenizer_config.json`'s `chat_template`), rendered as transformers renders it for vLLM.

vLLM renders a chat request's messages with the template (the generation prompt added) and
tokenizes the result without adding special tokens (the template writes them); a completion's
prompt is tokenized with them (the tokenizer's post-processor: a BOS, say). Text content is
counted exactly; a content part without text (an image) counts the caller's `image_tokens`.
Without a template, chat messages count their content plus `MESSAGE_TOKENS` each (and once for
the assistant's header): an upper bound where the template adds no more than that a message.

Loaded once per path and process; a file changed on disk is loaded again on its next use, and
one that no longer loads leaves the last good one in force.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from llmgw.facts import MESSAGE_TOKENS
from llmgw.reload import Stamp, stamp

log = logging.getLogger(__name__)

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")


class TokenizerError(Exception):
    """A tokenizer (or its chat template) that does not load."""


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _environment() -> jinja2.Environment:
    """transformers' environment for chat templates (trim_blocks, lstrip_blocks, loop controls,
    its tojson and raise_exception)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = _raise
    return env


@dataclass(frozen=True, slots=True)
class Prompt:
    tokens: int
    # Its token IDs as the pod sees them, where one prompt is known exactly (chat without images,
    # one text or token-ID prompt): what its prefix-cache blocks hash (llmgw/kvblocks.py).
    ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class PromptCounter:
    tokenizer: Tokenizer
    template: jinja2.Template | None
    special: Mapping[str, str]  # bos_token and the like, as the template reads them

    def request(self, request: Mapping[str, Any], image_tokens: int) -> Prompt | None:
        """The prompt of an OpenAI body (chat `messages`, else `prompt` or `input`: a string,
        strings, or token IDs, which count themselves); None where the pod would refuse the
        prompt before counting it (a template that refuses the messages, a lone surrogate,
        which is no UTF-8)."""
        try:
            return self._request(request, image_tokens)
        except (jinja2.TemplateError, TypeError, ValueError):  # UnicodeEncodeError is one
            return None

    def _request(self, request: Mapping[str, Any], image_tokens: int) -> Prompt:
        messages = request.get("messages")
        if isinstance(messages, list):
            return self.chat(messages, request.get("tools"), image_tokens)
        prompts: list[Sequence[int]] = []
        for name in ("prompt", "input"):
            value = request.get(name)
            if isinstance(value, list) and value and all(isinstance(t, int) for t in value):
                prompts.append(value)
                continue
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, str):
                    prompts.append(self.text(item).ids)
                elif isinstance(item, int):
                    prompts.append([item])
                elif isinstance(item, list):  # a batch of token-ID prompts
                    prompts.append([t for t in item if isinstance(t, int)])
        total = sum(map(len, prompts))
        return Prompt(total, tuple(prompts[0]) if len(prompts) == 1 else ())

    def text(self, prompt: str) -> Prompt:
        """A completion's prompt: the special tokens its tokenizer adds included."""
        ids = self.tokenizer.encode(prompt, add_special_tokens=True).ids
        return Prompt(len(ids), tuple(ids))

    def chat(self, messages: Sequence[Any], tools: object = None, image_tokens: int = 0) -> Prompt:
        """A chat request's prompt; raises TemplateError where the template refuses it (vLLM
        then refuses the request)."""
        conversation, images = _conversation(messages)
        if self.template is None:
            texts = [v for m in conversation for v in m.values() if isinstance(v, str)]
            texts += [json.dumps(m["tool_calls"]) for m in conversation if m.get("tool_calls")]
            texts += [json.dumps(tools)] if tools else []
            tokens = MESSAGE_TOKENS * (len(conversation) + 1) + sum(map(self._plain, texts))
            return Prompt(tokens + images * image_tokens)
        rendered = self.template.render(
            messages=conversation,
            tools=tools if isinstance(tools, list) and tools else None,
            documents=None,
            add_generation_prompt=True,
            **self.special,
        )
        ids = self.tokenizer.encode(rendered, add_special_tokens=False).ids if rendered else []
        # An image's tokens sit inside the prompt: the IDs past it are not the pod's.
        return Prompt(len(ids) + images * image_tokens, () if images else tuple(ids))

    def _plain(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids) if text else 0


def _conversation(messages: Sequence[Any]) -> tuple[list[dict[str, Any]], int]:
    """The messages as vLLM hands them to a template of string content (text parts joined by a
    newline), and how many parts were not text."""
    out: list[dict[str, Any]] = []
    images = 0
    for message in messages:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, list):
            texts = [
                p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
            ]
            images += len(content) - len(texts)
            content = "\n".join(texts)
        out.append({**message, "content": content})
    return out, images


def load(path: Path) -> PromptCounter:
    """Raises TokenizerError naming what does not load."""
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # the package raises a bare Exception for a bad file
        raise TokenizerError(f"{path}: not a tokenizer.json: {exc}") from exc
    config: dict[str, Any] = {}
    config_path = path.parent / CONFIG_FILE
    try:
        if config_path.exists():
            config = json.loads(config_path.read_text())
        source = _template_source(path.parent / TEMPLATE_FILE, config)
        template = _environment().from_string(source) if source is not None else None
    except (OSError, ValueError, jinja2.TemplateError) as exc:
        raise TokenizerError(f"{path.parent}: its chat template does not load: {exc}") from exc
    special = {name: token for name in _SPECIAL if (token := _token(config.get(name)))}
    return PromptCounter(tokenizer, template, special)


def _template_source(path: Path, config: Mapping[str, Any]) -> str | None:
    if path.exists():
        return path.read_text()
    found = config.get("chat_template")
    if isinstance(found, list):  # named templates: transformers uses "default"
        found = next((t.get("template") for t in found if t.get("name") == "default"), None)
    return found if isinstance(found, str) else None


def _token(value: object) -> str:
    if isinstance(value, dict):  # an AddedToken as saved: {"content": "<s>", …}
        value = value.get("content")
    return value if isinstance(value, str) else ""


_loaded: dict[Path, tuple[Stamp, PromptCounter]] = {}
_lock = threading.Lock()


def counter(path: Path) -> PromptCounter:
    """The counter of `path`, loaded again when the file (or its template) changed; the last
    good one when it no longer loads. Raises TokenizerError when none ever loaded."""
    now = _stamp(path)
    with _lock:
        held = _loaded.get(path)
        if held is not None and held[0] == now:
            return held[1]
        try:
            fresh = load(path)
        except TokenizerError:
            if held is None:
                raise
            log.exception("tokenizer not reloaded: the last good one stays")
            _loaded[path] = (now, held[1])  # not tried again until it changes
            return held[1]
        _loaded[path] = (now, fresh)
        return fresh


def _stamp(path: Path) -> Stamp:
    """The tokenizer's, its template's and its config's: any changed is a new tokenizer."""
    return stamp([path, path.parent / TEMPLATE_FILE, path.parent / CONFIG_FILE])
