"""From what Envoy sends to a `PickRequest`: extauthz's tenant context and request facts, which
Envoy forwards in the ext_proc request's metadata (`forwarding_namespaces`). Without extauthz in
front (the router alone as an endpoint picker) only the client's session header is used: it
keeps a conversation on one pod, and names no pod."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmgw import wire
from llmgw.facts import RequestFacts
from llmgw.tenant import TenantContext
from router.types import PickRequest


def from_metadata(meta: Mapping[str, Any], request_id: str | None = None) -> PickRequest:
    """extauthz's namespace as a dict. Missing or malformed values are left out (fail open)."""
    return from_context(
        TenantContext.from_metadata(meta), RequestFacts.from_metadata(meta), request_id
    )


def from_context(
    context: TenantContext, facts: RequestFacts, request_id: str | None = None
) -> PickRequest:
    """extauthz's tenant context and request facts: typed inside the check, else as read from
    its metadata."""
    return PickRequest(
        model=facts.model,
        tenant=context.tenant or None,
        priority=context.priority,
        session=context.session or None,
        request_id=request_id or context.request_id or None,
        prefix_blocks=facts.prefix_blocks,
        kv_blocks=facts.kv_blocks,
        kv_block_size=facts.kv_block_size,
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
