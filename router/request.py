"""From what Envoy sends to a `PickRequest`: extauthz's tenant context and request facts, which
Envoy forwards in the ext_proc request's metadata (`forwarding_namespaces`). Without extauthz in
front (the router alone as an endpoint picker) only the client's session header is used: it
keeps a conversation on one pod, and names no pod."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmgw import wire
from llmgw.facts import RequestFacts
from router.types import PickRequest


def from_metadata(meta: Mapping[str, Any], request_id: str | None = None) -> PickRequest:
    """extauthz's namespace as a dict. Missing or malformed values are left out (fail open)."""
    facts = RequestFacts.from_metadata(meta)
    priority = meta.get(wire.META_PRIORITY)
    return PickRequest(
        model=facts.model,
        tenant=_text(meta.get(wire.META_TENANT)),
        priority=int(priority)
        if isinstance(priority, float | int) and 1 <= priority <= 10
        else None,
        session=_text(meta.get(wire.META_SESSION)),
        request_id=request_id or _text(meta.get(wire.META_REQUEST_ID)),
        prefix_blocks=facts.prefix_blocks,
        prompt_tokens=facts.prompt_tokens,
        first_turn=facts.first_turn,
    )


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def from_headers(headers: Mapping[str, str]) -> PickRequest:
    """No extauthz metadata: the `x-session-id` header, for affinity only."""
    return PickRequest(
        session=_text(headers.get(wire.HEADER_SESSION)),
        request_id=_text(headers.get(wire.HEADER_REQUEST_ID)),
    )
