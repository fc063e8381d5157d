"""From what Envoy sends to a `PickRequest`: trusted headers (set by extauthz), then the body."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from llmgw import wire
from router.prefix import block_hashes, is_first_turn, parse_body, render
from router.types import PickRequest


def from_headers(headers: Mapping[str, str]) -> PickRequest:
    """Headers with lower-case names. A malformed priority is ignored."""
    raw_priority = headers.get(wire.HEADER_PRIORITY)
    priority = int(raw_priority) if raw_priority and raw_priority.isdigit() else None
    return PickRequest(
        model=headers.get(wire.HEADER_MODEL) or None,
        tenant=headers.get(wire.HEADER_TENANT) or None,
        priority=priority,
        session=headers.get(wire.HEADER_SESSION) or None,
        request_id=headers.get(wire.HEADER_REQUEST_ID) or None,
    )


def with_body(req: PickRequest, raw: bytes, max_blocks: int) -> PickRequest:
    """The model named in the body wins; the prompt gives the prefix blocks."""
    body = parse_body(raw)
    if body is None:
        return req
    model = body.get("model")
    return dataclasses.replace(
        req,
        model=model if isinstance(model, str) and model else req.model,
        prefix_blocks=block_hashes(render(body), max_blocks),
        first_turn=is_first_turn(body),
    )
