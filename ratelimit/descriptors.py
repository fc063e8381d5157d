"""The descriptor contract between Envoy and this service (domain `llmgw`).

Envoy builds descriptors from extauthz's dynamic metadata (namespace
`envoy.filters.http.ext_authz`, keys tenant, tier, session, request_id, token_estimate; see
llmgw/wire.py). Every descriptor starts with an entry `kind` (a `generic_key` action with
`descriptor_key: kind`) naming its role:

Request time (one RateLimitRequest, decided with one atomic store call):
    kind=requests  tenant=T  tier=X  [session=S]              count 1 request
    kind=tokens    tenant=T  tier=X  request_id=R  token_estimate=N  [token_prompt=P  token_n=S]
                   [model=M  token_ceiling=C]             reserve N tokens under R
  Request-time descriptors arrive with hits_addend 0 (count 1), which is why the reservation
  size travels as the entry `token_estimate`. Both are checked together: admitted only if the
  request and its tokens fit, and then both are counted. N = P + cap × S: with both parts, a
  hard budget with less than N left (but at least P + S) admits the request at a lower cap
  (types.Grant) instead of refusing it. M and C price the request's worst case for money
  budgets (without M: the price table's dearest prices).

Tokens are settled after the response by the ledger (ledger/), from Envoy's access log.

A descriptor's `limit` (Envoy's `limit: {dynamic_metadata}` override from extauthz's
limit_requests / limit_tokens: the per-minute limits of the tenant's spec; its budgets do not
travel here) replaces the tier's limit of that unit for its kind, by the tier table's rule
(llmgw/tiers.py TierTable.tenant_spec).

Descriptors with another domain, another `kind`, or missing entries are answered OK and not
counted. Envoy leaves out a descriptor when one of its metadata keys is absent (except those
marked `skip_if_absent`), so an unauthenticated request is never counted here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from envoy.service.ratelimit.v3 import rls_pb2

from llmgw import wire
from llmgw.tenant import TenantContext
from ratelimit.limits import own_limits
from ratelimit.types import Admission, Grant, Limit, Unit

KIND = "kind"
Role = Literal["requests", "tokens"]
_RateLimit = rls_pb2.RateLimitResponse.RateLimit
UNITS: dict[Unit, int] = {
    Unit.SECOND: _RateLimit.SECOND,
    Unit.MINUTE: _RateLimit.MINUTE,
    Unit.HOUR: _RateLimit.HOUR,
    Unit.DAY: _RateLimit.DAY,
}
UNIT_OF = {code: unit for unit, code in UNITS.items()}


@dataclass(frozen=True, slots=True)
class Parsed:
    """A request's descriptors: each one's role (None: ignored), and what to decide."""

    roles: tuple[Role | None, ...]
    admission: Admission | None


def _int(value: str | None) -> int | None:
    try:
        return max(0, int(value)) if value is not None else None
    except ValueError:
        return None


def _limit(descriptor: rls_pb2.RateLimitDescriptor) -> Limit | None:
    if not descriptor.HasField("limit"):
        return None
    unit = UNIT_OF.get(descriptor.limit.unit)
    return Limit(unit, descriptor.limit.requests_per_unit) if unit is not None else None


def parse(request: rls_pb2.RateLimitRequest) -> Parsed:
    roles: list[Role | None] = []
    if request.domain != wire.RATELIMIT_DOMAIN:
        return Parsed((None,) * len(request.descriptors), None)
    # The tenant context's entries, as Envoy copied them from extauthz's metadata: read as the
    # router apart and the ledger read that metadata (llmgw/tenant.py).
    copied: dict[str, str] = {}
    estimate: int | None = None
    grant: Grant | None = None
    counted = False
    requests_limit = tokens_limit = None
    model: str | None = None
    ceiling = 0
    for descriptor in request.descriptors:
        entries = {e.key: e.value for e in descriptor.entries}
        kind = entries.get(KIND)
        role: Role | None = None
        if (kind == "requests" or kind == "tokens") and entries.get(wire.META_TENANT):
            copied.update(entries)
            if kind == "requests":
                counted, role = True, "requests"
                requests_limit = _limit(descriptor)
            else:
                tokens_limit = _limit(descriptor)
                if (n := _int(entries.get(wire.META_TOKEN_ESTIMATE))) is not None:
                    estimate, role = n, "tokens"
                    prompt = _int(entries.get(wire.META_TOKEN_PROMPT))
                    choices = _int(entries.get(wire.META_TOKEN_CHOICES))
                    if prompt is not None and choices:
                        grant = Grant(prompt, choices)
                    model = entries.get(wire.META_MODEL)
                    ceiling = _int(entries.get(wire.META_TOKEN_CEILING)) or 0
        roles.append(role)
    context = TenantContext.from_metadata(copied)
    admission = None
    if context.tenant and (counted or estimate is not None):
        admission = Admission(
            context.tenant,
            context.tier,
            context.session or None,
            context.request_id or None,
            estimate,
            counted,
            own=own_limits(requests_limit, tokens_limit),
            grant=grant,
            model=model,
            prompt_ceiling=ceiling,
        )
    return Parsed(tuple(roles), admission)
