"""The admin API's nouns: its errors (OpenAI's error shape), pages, rows and request bodies."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, TypeVar

from pydantic import AwareDatetime, Field

from extauthz.types import ApiKey, Tenant
from llmgw.config import Strict

T = TypeVar("T")

MAX_LIMIT = 1000
DEFAULT_LIMIT = 100
DEFAULT_DAYS = 30  # a report's window with no start: the last 30 UTC days, today's included
MAX_DAYS = 366  # the longest window a report reads


class ApiError(Exception):
    """An answer other than success, as OpenAI's `{"error": {message, type, param, code}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        param: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type

    def body(self) -> dict[str, Any]:
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return {"error": error}

    @classmethod
    def invalid(cls, param: str | None, message: str) -> ApiError:
        where = f"{param}: " if param else ""
        return cls(400, where + message, "invalid_value", param)

    @classmethod
    def not_found(cls, what: str, id: str) -> ApiError:
        return cls(404, f"no {what} {id!r}", "not_found")

    @classmethod
    def conflict(cls, message: str, param: str | None = None) -> ApiError:
        return cls(409, message, "conflict", param)


@dataclass(frozen=True)
class PageRequest:
    """`?limit=&after=`: at most `limit` items whose ID sorts after `after` (the last one seen)."""

    limit: int = DEFAULT_LIMIT
    after: str | None = None


@dataclass(frozen=True)
class Page(Generic[T]):
    data: list[T]
    has_more: bool
    last_id: str | None

    @classmethod
    def of(cls, rows: Sequence[T], limit: int, id_of: Callable[[T], object]) -> Page[T]:
        """The page from `limit + 1` rows fetched: the extra one only says there are more."""
        data = list(rows[:limit])
        return cls(data, len(rows) > limit, str(id_of(data[-1])) if data else None)


@dataclass(frozen=True)
class TenantRow:
    """A row of `tenants`: the spec (extauthz's Tenant, its keys left out) and its revision."""

    spec: Tenant
    rev: int
    deleted: bool
    updated: datetime

    def view(self) -> dict[str, Any]:
        spec = self.spec.model_dump(mode="json", exclude={"keys"})
        return {
            "object": "tenant",
            **spec,
            "rev": self.rev,
            "deleted": self.deleted,
            "updated": self.updated.isoformat(),
        }


@dataclass(frozen=True)
class KeyRow:
    """A row of `api_keys`. Its view has no hash: the hash of a guessable key finds the key."""

    tenant: str
    key: ApiKey

    def view(self) -> dict[str, Any]:
        k = self.key
        return {
            "object": "api_key",
            "id": k.id,
            "tenant": self.tenant,
            "prefix": k.prefix,
            "created": k.created.isoformat(),
            "expires": k.expires.isoformat() if k.expires else None,
            "revoked": k.revoked,
        }


class KeyCreate(Strict):
    expires_at: AwareDatetime | None = None


class KeyRotate(Strict):
    # How long the old key keeps working beside the new one; None: the service's default.
    overlap_seconds: float | None = Field(default=None, ge=0, le=366 * 86_400)


_WHOLE = re.compile(r"[0-9]{1,18}")  # ASCII digits only (str.isdigit takes "²"), within int8


def whole(raw: str | None) -> int | None:
    """A query or form value as a non-negative integer; None: not one."""
    return int(raw) if raw is not None and _WHOLE.fullmatch(raw) else None
