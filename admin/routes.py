"""Every route of the admin API, once: the router (admin/api.py) serves this table and the
OpenAPI document (admin/openapi.py) describes it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from admin.types import DEFAULT_DAYS, DEFAULT_LIMIT, MAX_DAYS, MAX_LIMIT, KeyCreate, KeyRotate
from extauthz.types import Tenant

PREFIX = "/admin/v1"


@dataclass(frozen=True)
class Param:
    """A query parameter."""

    name: str
    description: str
    schema: dict[str, Any]


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # aiohttp's template, which is OpenAPI's: /tenants/{id}
    operation: str  # the OpenAPI operationId, and the name of its handler
    summary: str
    query: tuple[Param, ...] = ()
    # The request body's model; Tenant's is sent without `keys`, all of it on POST, any of
    # its fields on PATCH (`partial`).
    body: type[BaseModel] | None = None
    partial: bool = False
    lists: bool = False  # answers a page: {"object": "list", "data", "has_more", "last_id"}
    auth: bool = True  # needs `Authorization: Bearer <admin token>`


PAGE = (
    Param(
        "limit",
        f"items in a page (1 to {MAX_LIMIT})",
        {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT, "default": DEFAULT_LIMIT},
    ),
    Param("after", "the last_id of the previous page", {"type": "string"}),
)
TENANT = Param("tenant", "only this tenant's", {"type": "string"})
TIME = {"type": "string", "format": "date-time"}

ROUTES: tuple[Route, ...] = (
    Route("GET", "/health", "health", "200 while the database answers", auth=False),
    Route("GET", "/metrics", "metrics", "Prometheus metrics", auth=False),
    Route("GET", "/openapi.json", "openapi", "This document", auth=False),
    Route("GET", f"{PREFIX}/openapi.json", "openapi_admin", "This document", auth=False),
    Route("GET", f"{PREFIX}/tenants", "list_tenants", "Tenants, by ID", PAGE, lists=True),
    Route("POST", f"{PREFIX}/tenants", "create_tenant", "Create a tenant", body=Tenant),
    Route("GET", f"{PREFIX}/tenants/{{id}}", "get_tenant", "A tenant"),
    Route(
        "PATCH",
        f"{PREFIX}/tenants/{{id}}",
        "update_tenant",
        "Change the fields of a tenant the body names",
        body=Tenant,
        partial=True,
    ),
    Route(
        "DELETE",
        f"{PREFIX}/tenants/{{id}}",
        "delete_tenant",
        "Delete a tenant (kept as a tombstone) and revoke its keys",
    ),
    Route("GET", f"{PREFIX}/tenants/{{id}}/keys", "list_keys", "A tenant's keys", PAGE, lists=True),
    Route(
        "GET",
        f"{PREFIX}/tenants/{{id}}/breaker",
        "get_breaker",
        "A tenant's breaker now, from Redis: closed, open or half_open; until, admits,"
        " tripped_at, cooldown_s",
    ),
    Route(
        "POST",
        f"{PREFIX}/tenants/{{id}}/keys",
        "create_key",
        "Create a key: its secret is in the answer's `key`, this once",
        body=KeyCreate,
    ),
    Route("DELETE", f"{PREFIX}/keys/{{key_id}}", "revoke_key", "Revoke a key"),
    Route(
        "POST",
        f"{PREFIX}/keys/{{key_id}}/rotate",
        "rotate_key",
        "A new key for the key's tenant (its secret in `key`, this once); the old one expires"
        " after the overlap",
        body=KeyRotate,
    ),
    Route(
        "GET",
        f"{PREFIX}/usage",
        "usage",
        "Requests, tokens and cost from the ledger, grouped",
        (
            TENANT,
            Param(
                "since",
                "from this time (inclusive; no zone: UTC); by default the last"
                f" {DEFAULT_DAYS} UTC days, today's included; at most {MAX_DAYS} days before"
                " `until` (or now)",
                TIME,
            ),
            Param("until", "to this time (exclusive; no zone: UTC; by default none)", TIME),
            Param(
                "group_by",
                "the totals' key",
                {"enum": ["tenant", "model", "day"], "default": "tenant"},
            ),
            *PAGE,
        ),
        lists=True,
    ),
    Route(
        "GET",
        f"{PREFIX}/sessions/{{id}}",
        "get_session",
        "A session's requests in time order, with their pod, queue, TTFT and decode times (a"
        " page at a time)",
        PAGE,
        lists=True,
    ),
    Route(
        "GET",
        f"{PREFIX}/breakers",
        "breakers",
        "Tenant breaker trips and recoveries",
        (TENANT, *PAGE),
        lists=True,
    ),
    Route(
        "GET",
        f"{PREFIX}/breakers/open",
        "open_breakers",
        "The breakers not closed now (open or half_open) among a page of tenants by ID: `data`"
        " may be shorter than `limit`, even empty, while `has_more`; `last_id` is the page's"
        " last tenant",
        PAGE,
        lists=True,
    ),
    Route("GET", f"{PREFIX}/alerts", "alerts", "Alerts", (TENANT, *PAGE), lists=True),
    Route("GET", f"{PREFIX}/audit", "audit", "Every change, oldest first", PAGE, lists=True),
)
