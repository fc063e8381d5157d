"""What a request body means, decided without the database: a tenant's spec (extauthz's
`Tenant`, the one contract of a tenant), a change to it, a key's options. Every refusal is a 400
naming the parameter at fault."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from admin.types import ApiError
from extauthz.types import Tenant
from llmgw.tiers import TierTable

M = TypeVar("M", bound=BaseModel)
_FIELD = re.compile(r"^[A-Za-z0-9_]+$")
KEYS_APART = "keys are made with POST /admin/v1/tenants/{id}/keys, never sent in a tenant"


def validated(model: type[M], data: object) -> M:
    """`data` as `model`, or a 400 naming the first field at fault."""
    if not isinstance(data, Mapping):
        raise ApiError.invalid(None, "the body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        raise ApiError.invalid(_param(error["loc"]), error["msg"]) from exc


def _param(loc: tuple[int | str, ...]) -> str | None:
    """The field's dotted path, without pydantic's names of union members ("literal['*']")."""
    parts: list[str] = []
    for part in loc:
        if not _FIELD.match(str(part)):
            break
        parts.append(str(part))
    return ".".join(parts) or None


def new_tenant(body: object, table: TierTable) -> Tenant:
    if isinstance(body, Mapping) and "keys" in body:
        raise ApiError.invalid("keys", KEYS_APART)
    return _known_tier(validated(Tenant, body), table)


def changed_tenant(current: Tenant, body: object, table: TierTable) -> Tenant:
    """`current` with the fields `body` names replaced (a merge patch of the top level)."""
    if not isinstance(body, Mapping):
        raise ApiError.invalid(None, "the body must be a JSON object")
    if "keys" in body:
        raise ApiError.invalid("keys", KEYS_APART)
    if body.get("id", current.id) != current.id:
        raise ApiError.invalid("id", "a tenant's id never changes")
    merged: dict[str, Any] = {**spec_of(current), **body}
    return _known_tier(validated(Tenant, merged), table)


def spec_of(tenant: Tenant) -> dict[str, Any]:
    """What `tenants.spec` holds: the tenant as JSON without its keys (rows of api_keys)."""
    return tenant.model_dump(mode="json", exclude={"keys"})


def _known_tier(tenant: Tenant, table: TierTable) -> Tenant:
    known = table.all_tiers
    if tenant.tier not in known:
        raise ApiError.invalid(
            "tier", f"unknown tier {tenant.tier!r} (the tier table has {', '.join(sorted(known))})"
        )
    return tenant
