"""A request body read once into what the decision needs of it, and nothing else.

Pure and picklable both ways, so that a large body can be read in another process (the service's
body pool) while the event loop keeps deciding other tenants' requests: `json.loads` holds the GIL
for its whole run (about 20 ms a MiB), and so does tokenizing the prompt (0.2-0.5 s a MiB), so a
thread would not help.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from extauthz.settings import DecisionSettings
from llmgw import facts, kvblocks, responses, wire
from llmgw.facts import RequestFacts

_MODEL_NAME = re.compile(r"[\x21-\x7e]{1,256}")  # printable ASCII: safe as a header value


@dataclass(frozen=True, slots=True)
class Body:
    kind: Literal["none", "object", "invalid", "too_deep"]
    empty: bool = False  # an object without members
    has_model: bool = False  # a "model" member is present
    model_text: bool = False  # … and it is a non-empty string
    model: str | None = None  # … and a valid model name
    model_shown: str = ""  # the member as sent, shortened, for messages
    cap_named: bool = False  # the client names its output cap (facts.asked_output)
    # A non-null max_completion_tokens, which chat reads before max_tokens.
    completion_cap: bool = False
    # Not yet the tenant's: prefix not hashed, output capped only by the client (`for_tenant`).
    facts: RequestFacts = field(default_factory=RequestFacts)
    prefix_text: str = ""  # the rendered prompt's leading part that the prefix blocks cover
    # The leading token IDs that the pods' KV blocks cover (where the model has a tokenizer).
    prefix_tokens: tuple[int, ...] = ()
    # What a Responses request asks of a store of responses, as vLLM reads it: `store` (None:
    # not sent, which vLLM takes as true), `background`, and `previous_response_id` (a value
    # that is no string is kept as its repr, which names no response).
    store: bool | None = None
    background: bool = False
    previous: str | None = None

    @property
    def stateful(self) -> str | None:
        """The first member that needs a stored response, for a gateway that keeps none."""
        if self.store:
            return "store"
        if self.background:
            return "background"
        return None if self.previous is None else "previous_response_id"

    def for_tenant(
        self, cache_group: str, salt: str, settings: DecisionSettings, max_output: int
    ) -> RequestFacts:
        """The facts with the prefix hashed for this cache group (tenants' prefixes differ; the
        pods' blocks with its `cache_salt`) and the output cap lowered to `max_output`."""
        blocks = facts.block_hashes(self.prefix_text, settings.max_prefix_blocks, cache_group)
        hashing = settings.kv_hashing
        kv = kvblocks.block_hashes(self.prefix_tokens, hashing, salt) if self.prefix_tokens else ()
        cap = min(self.facts.max_output, max_output)
        return dataclasses.replace(
            self.facts,
            prefix_blocks=blocks,
            kv_blocks=kv,
            kv_block_size=hashing.block_size if kv else 0,
            max_output=cap,
        )


def read(raw: bytes, settings: DecisionSettings, path: str) -> Body:
    """The body of a request to `path` (without its query)."""
    if not raw:
        return Body("none")
    try:
        # UTF-8 only: json.loads would take UTF-16 or UTF-32 bytes too, which the pod may read
        # otherwise than we did. A BOM is refused as well (json.loads refuses it in a str).
        request = json.loads(raw.decode())
    except RecursionError:  # Python's parser gives up around 1,000 levels; the pod's too
        return Body("too_deep")
    except ValueError:
        return Body("invalid")
    if not isinstance(request, dict):
        return Body("invalid")
    if path == wire.RESPONSES_PATH:
        store, previous = request.get("store"), request.get("previous_response_id")
        return _summary(
            responses.as_chat(request),
            settings,
            None if store is None else facts.lax_bool(store),
            facts.lax_bool(request.get("background")),
            previous if isinstance(previous, str) or previous is None else repr(previous)[:300],
        )
    return _summary(request, settings)


def _summary(
    request: dict[str, Any],
    settings: DecisionSettings,
    store: bool | None = None,
    background: bool = False,
    previous: str | None = None,
) -> Body:
    name = request.get("model")
    model = name if isinstance(name, str) and _MODEL_NAME.fullmatch(name) else None
    size = facts.prompt_size(request, settings.chars_per_token, settings.image_tokens)
    prompt = settings.prompt(request, model) if size.bound <= settings.tokenize_max_bytes else None
    if prompt is not None:
        size = dataclasses.replace(size, counted=prompt.tokens)
    kv = settings.kv_hashing
    parsed = facts.from_body(
        request,
        chars_per_token=settings.chars_per_token,
        image_tokens=settings.image_tokens,
        max_output=facts.MAX_OUTPUT_TOKENS,
        max_blocks=0,
        model=model,
        prompt=size,
    )
    return Body(
        "object",
        empty=not request,
        has_model="model" in request,
        model_text=isinstance(name, str) and bool(name),
        model=model,
        model_shown=repr(name)[:300],
        cap_named=facts.asked_output(request) is not None,
        completion_cap=request.get("max_completion_tokens") is not None,
        facts=parsed,
        prefix_text=facts.render(request)[: settings.max_prefix_blocks * facts.BLOCK_CHARS],
        prefix_tokens=prompt.ids[: kv.max_blocks * kv.block_size] if prompt is not None else (),
        store=store,
        background=background,
        previous=previous,
    )
