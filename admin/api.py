"""The HTTP adapter: the route table (admin/routes.py) served with aiohttp, JSON in and out.

One middleware wraps every request: the admin token (compared in constant time) on every route
but the table's open ones, OpenAI's error shape for every refusal (the router's 404 and 405
too), a 503 while the database fails, the metrics and an access log line (never a header or a
body: they carry the token and the keys). Handlers only parse, call the store, and render."""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, TypeVar

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from pydantic import BaseModel

from admin import console, metrics
from admin.breakers import BreakerStates
from admin.logins import Logins
from admin.openapi import document
from admin.reports import GROUP_KEYS, EventKind, GroupBy, Reports, Window
from admin.routes import ROUTES
from admin.specs import new_tenant, validated
from admin.store import Store, database_error
from admin.types import (
    DEFAULT_LIMIT,
    MAX_LIMIT,
    ApiError,
    KeyCreate,
    KeyRotate,
    Page,
    PageRequest,
    whole,
)

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
M = TypeVar("M", bound=BaseModel)
MAX_BODY_BYTES = 1024 * 1024
OPEN = frozenset(r.path for r in ROUTES if not r.auth)
GROUPS: dict[str, GroupBy] = {g: g for g in GROUP_KEYS}
ROUTER_ERRORS = {
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
}


def _default(value: object) -> object:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Decimal):  # an amount of money (ledger/usage.py: exact in SQL)
        return float(value)
    raise TypeError(f"not JSON: {type(value).__name__}")


def answer(body: object, status: int = 200) -> web.Response:
    text = json.dumps(body, default=_default)
    return web.Response(text=text, status=status, content_type="application/json")


def page_body(page: Page[Any], view: Callable[[Any], dict[str, Any]] = dict) -> dict[str, Any]:
    data = [view(item) for item in page.data]
    return {"object": "list", "data": data, "has_more": page.has_more, "last_id": page.last_id}


class Admin:
    def __init__(
        self,
        store: Store,
        reports: Reports,
        token: str,
        overlap_s: float,
        breaker_states: BreakerStates | None = None,  # None: no Redis: not served
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.store = store
        self.reports = reports
        self.breaker_states = breaker_states or BreakerStates(None)
        self._bearer = f"Bearer {token}".encode()
        self.overlap_s = overlap_s
        self.clock = clock
        self._document = json.dumps(document(ROUTES))
        self.console = console.Console(
            store, reports, Logins(token), overlap_s, clock, breaker_states=self.breaker_states
        )

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=MAX_BODY_BYTES)
        for route in ROUTES:
            handler: Handler = getattr(self, route.operation)
            app.router.add_route(route.method, route.path, handler)
        app.add_subapp(console.PREFIX, self.console.app())
        return app

    # The middleware.

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        start = time.perf_counter()
        resource = request.match_info.route.resource
        route = f"{request.method} {resource.canonical}" if resource is not None else "unmatched"
        try:
            if not self._open(request.path) and not self._authorized(request):
                raise ApiError(
                    401,
                    "missing or wrong admin token (Authorization: Bearer <admin token>)",
                    "invalid_api_key",
                )
            response = await handler(request)
        except ApiError as exc:
            response = answer(exc.body(), exc.status)
        except web.HTTPException as exc:  # the router's 404 and 405, the body limit's 413
            code = ROUTER_ERRORS.get(exc.status, "invalid_request")
            message = f"{request.method} {request.path}: {exc.reason}"
            response = answer(ApiError(exc.status, message, code).body(), exc.status)
            if "Allow" in exc.headers:
                response.headers["Allow"] = exc.headers["Allow"]
        except Exception as exc:
            error = database_error(exc)
            if error is None:
                log.exception("admin request failed", extra={"route": route})
                error = ApiError(500, "internal error", "internal_error", type="server_error")
            else:
                log.warning("database refused", extra={"route": route, "error": type(exc).__name__})
            response = answer(error.body(), error.status)
        seconds = time.perf_counter() - start
        metrics.REQUESTS.labels(route, f"{response.status // 100}xx").inc()
        metrics.SECONDS.labels(route).observe(seconds)
        log.info(
            "request",
            extra={"route": route, "status": response.status, "ms": round(seconds * 1000, 1)},
        )
        return response

    @staticmethod
    def _open(path: str) -> bool:
        """Open without the token: the table's open routes, and the console, which checks its
        own logins."""
        return path in OPEN or path.startswith(console.PREFIX + "/")

    def _authorized(self, request: web.Request) -> bool:
        given = request.headers.get("Authorization", "").encode(errors="surrogateescape")
        return hmac.compare_digest(given, self._bearer)

    # Parsing.

    @staticmethod
    def _page(request: web.Request, numeric: bool = False) -> PageRequest:
        """`limit` and `after`; `numeric`: the list's IDs are integers."""
        limit = whole(request.query.get("limit", str(DEFAULT_LIMIT)))
        if limit is None or not 1 <= limit <= MAX_LIMIT:
            raise ApiError.invalid("limit", f"an integer from 1 to {MAX_LIMIT}")
        after = request.query.get("after")
        if numeric and after is not None and whole(after) is None:
            raise ApiError.invalid("after", "the last_id of a page of this list (an integer)")
        return PageRequest(limit, after)

    @staticmethod
    async def _body(request: web.Request, model: type[M] | None = None) -> Any:
        """The JSON body (an absent one is {}), as `model` if given."""
        text = await request.text()
        try:
            body = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError as exc:
            raise ApiError.invalid(None, f"the body is not JSON: {exc}") from exc
        return body if model is None else validated(model, body)

    @staticmethod
    def _time(request: web.Request, name: str) -> datetime | None:
        raw = request.query.get(name)
        if raw is None:
            return None
        try:
            at = datetime.fromisoformat(raw)
        except ValueError as exc:
            raise ApiError.invalid(name, "an ISO 8601 time, e.g. 2026-12-01T00:00:00Z") from exc
        return at if at.tzinfo is not None else at.replace(tzinfo=UTC)

    # Open routes.

    async def health(self, request: web.Request) -> web.Response:
        await self.store.ping()
        return answer({"status": "ok"})

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(REGISTRY)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def openapi(self, request: web.Request) -> web.Response:
        return web.Response(text=self._document, content_type="application/json")

    openapi_admin = openapi

    # Tenants.

    async def list_tenants(self, request: web.Request) -> web.Response:
        page = await self.store.tenants(self._page(request))
        return answer(page_body(page, lambda t: t.view()))

    async def create_tenant(self, request: web.Request) -> web.Response:
        spec = new_tenant(await self._body(request), self.store.tiers())
        return answer((await self.store.create_tenant(spec)).view())

    async def get_tenant(self, request: web.Request) -> web.Response:
        return answer((await self.store.tenant(request.match_info["id"])).view())

    async def update_tenant(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        return answer((await self.store.update_tenant(request.match_info["id"], body)).view())

    async def delete_tenant(self, request: web.Request) -> web.Response:
        return answer((await self.store.delete_tenant(request.match_info["id"])).view())

    # Keys.

    async def list_keys(self, request: web.Request) -> web.Response:
        page = await self.store.keys(request.match_info["id"], self._page(request))
        return answer(page_body(page, lambda k: k.view()))

    async def create_key(self, request: web.Request) -> web.Response:
        body: KeyCreate = await self._body(request, KeyCreate)
        secret, key = await self.store.create_key(request.match_info["id"], body.expires_at)
        return answer({**key.view(), "key": secret})

    async def revoke_key(self, request: web.Request) -> web.Response:
        return answer((await self.store.revoke_key(request.match_info["key_id"])).view())

    async def rotate_key(self, request: web.Request) -> web.Response:
        body: KeyRotate = await self._body(request, KeyRotate)
        overlap = self.overlap_s if body.overlap_seconds is None else body.overlap_seconds
        secret, new, old = await self.store.rotate_key(request.match_info["key_id"], overlap)
        return answer({**new.view(), "key": secret, "rotated": old.view()})

    # What the ledger recorded.

    async def usage(self, request: web.Request) -> web.Response:
        group = GROUPS.get(request.query.get("group_by", "tenant"))
        if group is None:
            raise ApiError.invalid("group_by", f"one of {', '.join(GROUPS)}")
        window = Window.bounded(
            request.query.get("tenant"),
            self._time(request, "since"),
            self._time(request, "until"),
            self.clock(),
        )
        page = await self.reports.usage(window, group, self._page(request))
        return answer(page_body(page))

    async def get_session(self, request: web.Request) -> web.Response:
        page = await self.reports.session(request.match_info["id"], self._page(request))
        return answer(page_body(page))

    async def breakers(self, request: web.Request) -> web.Response:
        return await self._events(request, "breaker.")

    # The breakers as they stand now (admin/breakers.py: Redis).

    async def get_breaker(self, request: web.Request) -> web.Response:
        tenant = await self.store.tenant(request.match_info["id"])
        (state,) = await self.breaker_states.read([tenant], self.store.tiers())
        return answer(state.view())

    async def open_breakers(self, request: web.Request) -> web.Response:
        """Bounded: one page of tenants read (no SCAN of Redis), the tripped ones answered."""
        tenants = await self.store.tenants(self._page(request))
        states = await self.breaker_states.read(tenants.data, self.store.tiers())
        tripped = Page(
            [s for s in states if s.state != "closed"], tenants.has_more, tenants.last_id
        )
        return answer(page_body(tripped, lambda s: s.view()))

    async def alerts(self, request: web.Request) -> web.Response:
        return await self._events(request, "alert.")

    async def _events(self, request: web.Request, kind: EventKind) -> web.Response:
        page = self._page(request, numeric=True)
        return answer(page_body(await self.reports.events(kind, request.query.get("tenant"), page)))

    async def audit(self, request: web.Request) -> web.Response:
        return answer(page_body(await self.store.audit(self._page(request, numeric=True))))
