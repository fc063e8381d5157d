"""The admission of a request decided inside extauthz's Check: its facts as extauthz publishes
them (llmgw/wire.py), read into the Admission that Envoy's descriptors carry to `python -m
ratelimit` (ratelimit/descriptors.py), so either path decides the same request alike."""

from __future__ import annotations

from collections.abc import Mapping

from llmgw import wire
from llmgw.facts import MetaValue
from ratelimit.types import Admission, Grant, Limit, Unit

_UNITS = {unit.name: unit for unit in Unit}  # the metadata names units as Envoy does: "MINUTE"


def _int(value: MetaValue | None) -> int | None:
    try:
        return max(0, int(value)) if isinstance(value, str) else None
    except ValueError:
        return None


def _limit(value: MetaValue | None) -> Limit | None:
    """A tenant's own limit, as extauthz publishes it for Envoy's descriptor `limit` override."""
    if not isinstance(value, Mapping):
        return None
    unit, amount = _UNITS.get(str(value.get("unit"))), value.get("requests_per_unit")
    if unit is None or not isinstance(amount, float | int) or isinstance(amount, bool):
        return None
    return Limit(unit, max(0, int(amount)))


def from_metadata(meta: Mapping[str, MetaValue]) -> Admission | None:
    """None without a tenant (nothing to count). Like the descriptors: the token check needs the
    request ID and the estimate, the grant both of the estimate's parts."""
    tenant, tier = meta.get(wire.META_TENANT), meta.get(wire.META_TIER)
    if not isinstance(tenant, str) or not tenant or not isinstance(tier, str):
        return None
    session, request_id = meta.get(wire.META_SESSION), meta.get(wire.META_REQUEST_ID)
    # Envoy sends the token descriptor only with both strings present.
    tokens = isinstance(request_id, str) and isinstance(meta.get(wire.META_TOKEN_ESTIMATE), str)
    estimate = _int(meta.get(wire.META_TOKEN_ESTIMATE)) if tokens else None
    prompt = _int(meta.get(wire.META_TOKEN_PROMPT))
    choices = _int(meta.get(wire.META_TOKEN_CHOICES))
    grant = None
    if estimate is not None and prompt is not None and choices:
        grant = Grant(prompt, choices)
    return Admission(
        tenant,
        tier,
        session if isinstance(session, str) and session else None,
        request_id if isinstance(request_id, str) else None,
        estimate,
        requests_limit=_limit(meta.get(wire.META_LIMIT_REQUESTS)),
        tokens_limit=_limit(meta.get(wire.META_LIMIT_TOKENS)) if tokens else None,
        grant=grant,
    )
