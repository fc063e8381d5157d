"""The nouns of extauthz: the tenants file schema, the in-memory snapshot, and decisions."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from pydantic import AwareDatetime, Field, field_validator, model_validator

from llmgw import wire
from llmgw.config import Strict
from llmgw.facts import RequestFacts
from llmgw.tenant import TenantContext
from llmgw.tiers import Budget, PerUnit, Spend, TenantSpec, TierTable

KEY_PREFIX = wire.KEY_PREFIX
_NAME = r"^[a-z0-9][a-z0-9_.-]{0,62}$"


class PerMinuteLimits(Strict):
    """A tenant's own per-minute limits, in its spec (the tenants file's, or the admin API's):
    merged over its tier like the tier table's `tenants:` entry (llmgw/tiers.py TenantSpec).
    They travel with each request, as descriptor limits too, so a limiter apart applies them."""

    rpm: int | None = Field(default=None, gt=0)
    tpm: int | None = Field(default=None, gt=0)

    def spec(self) -> TenantSpec | None:
        """These limits in the tier table's schema; None: none."""
        if self.rpm is None and self.tpm is None:
            return None
        return TenantSpec(
            requests=None if self.rpm is None else PerUnit(minute=self.rpm),
            tokens=None if self.tpm is None else PerUnit(minute=self.tpm),
        )


class ApiKey(Strict):
    id: str = Field(pattern=r"^key_[a-z0-9]{8,32}$")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    prefix: str  # the first characters of the key, enough for a human to recognise it
    created: AwareDatetime
    expires: AwareDatetime | None = None
    revoked: bool = False

    @field_validator("prefix")
    @classmethod
    def _short_prefix(cls, value: str) -> str:
        if not value.startswith(KEY_PREFIX) or len(value) > len(KEY_PREFIX) + 4:
            raise ValueError(f"must be {KEY_PREFIX!r} and at most 4 more characters")
        return value


class Tenant(Strict):
    id: str = Field(pattern=_NAME)
    name: str = Field(min_length=1)
    tier: str  # a tier of the tier table (llmgw/tiers.py): checked when the snapshot is built
    priority: int = Field(ge=1, le=10)
    models: Literal["*"] | tuple[str, ...]
    limits: PerMinuteLimits = PerMinuteLimits()
    # The tenant's own budgets (tokens a day or hour; money a day or month), merged over its
    # tier's and its tier-table entry's as that entry's are. They reach the limiter inside
    # extauthz with each request, and the ledger's soft limits through its metadata.
    budget: Budget | None = None
    spend: Spend | None = None
    keys: tuple[ApiKey, ...] = ()
    # Tenants naming the same cache group share prefix-cache blocks on the pods (e.g. one system
    # prompt for a customer's several tenants). Without one, a tenant shares with nobody: a
    # shared cache is a timing oracle on another tenant's prompts.
    cache_group: str | None = Field(default=None, pattern=_NAME)

    def own(self) -> TenantSpec | None:
        """The tenant's own limits and budgets in the tier table's schema; None: none."""
        limits = self.limits.spec()
        if self.budget is None and self.spend is None:
            return limits
        return (limits or TenantSpec()).model_copy(
            update={"budget": self.budget, "spend": self.spend}
        )


class TenantsFile(Strict):
    """The whole tenants file."""

    tenants: tuple[Tenant, ...] = ()

    @model_validator(mode="before")
    @classmethod
    def _no_tiers(cls, data: object) -> object:
        if not (isinstance(data, dict) and "tiers" in data):
            return data
        if not data["tiers"]:  # files written before the tier table moved out: nothing in it
            return {k: v for k, v in data.items() if k != "tiers"}
        raise ValueError(
            "tiers: tiers are defined once, in the tier table (every service's tiers_file; "
            "llmgw/tiers.py), not in the tenants file"
        )

    @model_validator(mode="after")
    def _consistent(self) -> TenantsFile:
        tenant_ids: set[str] = set()
        key_ids: set[str] = set()
        digests: set[str] = set()
        for i, tenant in enumerate(self.tenants):
            where = f"tenants.{i}"
            if tenant.id in tenant_ids:
                raise ValueError(f"{where}.id: duplicate tenant {tenant.id!r}")
            tenant_ids.add(tenant.id)
            for j, key in enumerate(tenant.keys):
                if key.id in key_ids:
                    raise ValueError(f"{where}.keys.{j}.id: duplicate key id {key.id!r}")
                if key.sha256 in digests:
                    raise ValueError(f"{where}.keys.{j}.sha256: duplicate key hash")
                key_ids.add(key.id)
                digests.add(key.sha256)
        return self


@dataclass(frozen=True, slots=True)
class TenantView:
    """A tenant as the decision needs it, precomputed once per snapshot."""

    id: str
    tier: str
    priority: int
    models: frozenset[str] | None  # None: every model
    headers: tuple[tuple[str, str], ...]  # tenant, tier, priority
    own: TenantSpec | None  # the tenant's own limits and budgets, merged over its tier's
    cache_group: str  # "tenant/<id>" unless the tenant joined a group: "group/<name>"
    max_output: int | None = None  # the tier's output cap (tier table); None: the default
    token_ceiling: int | None = None  # the tenant's smallest token limit (llmgw.tiers)


@dataclass(frozen=True, slots=True)
class KeyEntry:
    digest: bytes
    key_id: str
    tenant: TenantView
    expires: float | None  # Unix seconds
    revoked: bool


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One immutable, validated tenants file and the tier table it was checked against;
    swapped as a whole on reload."""

    keys: Mapping[bytes, KeyEntry]  # by SHA-256 digest of the API key
    tenants: Mapping[str, TenantView]
    # The process's tier table (the rate limiter inside reads it from here: one load, one swap).
    tiers: TierTable


@dataclass(frozen=True, slots=True)
class Allow:
    """Typed until the answer writes it for Envoy (extauthz/answers.py)."""

    context: TenantContext
    facts: RequestFacts
    headers: tuple[tuple[str, str], ...]  # set on the upstream request
    headers_to_remove: tuple[str, ...]
    response_headers: tuple[tuple[str, str], ...]
    # What Envoy's Lua does to the request and its answer (envoy/rewrite.lua), when it does:
    body_suffix: str | None = None  # JSON members appended to the body (wire.META_BODY_SUFFIX)
    allowed_models: str | None = None  # the /v1/models the tenant sees (wire.META_ALLOWED_MODELS)
    # Stored responses (DecisionSettings.responses_store): the pod holding the response the
    # request names, where it must go; and whether its own response is stored, under an ID
    # that names the pod it goes to (chosen at the pick: extauthz/responseids.py).
    pinned: str | None = None
    stores: bool = False

    @property
    def tenant(self) -> str:  # as Deny's: whose decision, for the metrics and the span
        return self.context.tenant


@dataclass(frozen=True, slots=True)
class Deny:
    status: int
    code: str
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    tenant: str | None = None
    headers: tuple[tuple[str, str], ...] = ()  # besides content-type (retry-after)

    def body(self) -> bytes:
        """The OpenAI error envelope."""
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return json.dumps({"error": error}).encode()


Decision = Allow | Deny
