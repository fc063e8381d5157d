"""The trusted tenant context: whose request it is, as extauthz decided it.

extauthz writes it as dynamic metadata in its namespace (`to_metadata`, at its edge only: inside
the check the limiter and the router take the typed context); Envoy's rate-limit descriptors, the
router apart (ext_proc, the InferencePool picker) and the access log (hence the ledger) read it
there (`from_metadata`). It travels beside the request facts (llmgw/facts.py), in the same
namespace.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from llmgw import wire
from llmgw.facts import MetaValue
from llmgw.priority import TENANT_MAX, TENANT_MIN
from llmgw.tiers import Spend, TenantSpec


@dataclass(frozen=True, slots=True)
class TenantContext:
    tenant: str = ""
    tier: str = ""
    priority: int | None = None  # 1-10, 10 highest; None: unknown
    session: str = ""
    request_id: str = ""  # Envoy's x-request-id, or one extauthz minted
    key_id: str = ""  # the API key's ID, never the key
    # The tenant's own limits and budgets (its spec's), merged over its tier's by the limiter
    # inside extauthz. Written as metadata: the per-minute limits for Envoy's rate-limit
    # descriptors (their `limit` override), the money budgets for the ledger's soft limits.
    own: TenantSpec | None = None

    def to_metadata(self) -> dict[str, MetaValue]:
        meta: dict[str, MetaValue] = {
            wire.META_TENANT: self.tenant,
            wire.META_TIER: self.tier,
            wire.META_SESSION: self.session,
            wire.META_REQUEST_ID: self.request_id,
            wire.META_KEY_ID: self.key_id,
        }
        if self.priority is not None:
            meta[wire.META_PRIORITY] = float(self.priority)  # a Struct number is a double
        own = self.own
        if own is not None:
            for key, per in (
                (wire.META_LIMIT_REQUESTS, own.requests),
                (wire.META_LIMIT_TOKENS, own.tokens),
            ):
                if per is not None and isinstance(per.minute, int):
                    meta[key] = _per_minute(per.minute)
            if own.spend is not None:
                meta[wire.META_SPEND] = own.spend.model_dump_json(exclude_none=True)
        return meta

    @staticmethod
    def spend_of(meta: Mapping[str, Any]) -> Spend | None:
        """The tenant's own money budgets its metadata carries; None: none, or not readable."""
        value = meta.get(wire.META_SPEND)
        if not isinstance(value, str):
            return None
        try:
            return Spend.model_validate_json(value)
        except ValidationError:
            return None

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> TenantContext:
        """Tolerant: a missing or mistyped value takes its default (readers fail open)."""
        level = meta.get(wire.META_PRIORITY)
        priority = None
        if isinstance(level, float | int) and not isinstance(level, bool):
            priority = int(level) if TENANT_MIN <= level <= TENANT_MAX else None
        return cls(
            tenant=_text(meta.get(wire.META_TENANT)),
            tier=_text(meta.get(wire.META_TIER)),
            priority=priority,
            session=_text(meta.get(wire.META_SESSION)),
            request_id=_text(meta.get(wire.META_REQUEST_ID)),
            key_id=_text(meta.get(wire.META_KEY_ID)),
        )


def _per_minute(amount: int) -> dict[str, MetaValue]:
    """A limit as Envoy's descriptor `limit: {dynamic_metadata}` override reads it."""
    return {"requests_per_unit": float(amount), "unit": "MINUTE"}


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""
