"""The web console: server-rendered pages of the admin API's store and reports, under /console/.

One middleware guards every page but the login's: a live login (admin/logins.py) or a redirect
to the login page, and on every POST the login's CSRF token, else a 403. Pages are jinja2
templates (admin/templates/) with autoescape on, sent with a policy that allows no script at
all and no framing; none is cached (a key's secret is shown once, in the answer to its POST).
Handlers only parse a form, call the store or the reports the JSON API calls, and render."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote

import jinja2
from aiohttp import web

from admin import charts
from admin.breakers import BreakerState, BreakerStates
from admin.logins import COOKIE, LIFETIME_S, Logins
from admin.reports import Reports, Window, days_back
from admin.specs import new_tenant
from admin.store import Store
from admin.types import DEFAULT_DAYS, MAX_LIMIT, ApiError, KeyRow, PageRequest, TenantRow, whole
from extauthz.types import Tenant
from llmgw.tiers import Unit

PREFIX = "/console"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SID = web.RequestKey("console.session", str)  # the request's login, set by the middleware
DAYS = DEFAULT_DAYS  # the usage page's window: the API's default one
SESSIONS = 20  # the usage page's recent sessions
RECENT_ROWS = 10_000  # recent sessions: those of the tenant's latest requests in the window
TIMELINE = 200  # a session page's requests (then a link to the next page)
MAX_KEY_DAYS = 3650  # the longest expiry the key form offers
LIST = 100  # rows of a listing page
HEADERS = {
    "Cache-Control": "no-store",
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; img-src 'self';"
    " form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


@dataclass(frozen=True)
class Page:
    method: str
    path: str  # under PREFIX
    handler: str
    login: bool = True  # needs a login (and, a POST, its CSRF token)


PAGES: tuple[Page, ...] = (
    Page("GET", "/", "home", login=False),
    Page("POST", "/login", "login", login=False),
    Page("POST", "/logout", "logout"),
    Page("GET", "/tenants", "tenants"),
    Page("POST", "/tenants", "create_tenant"),
    Page("GET", "/tenants/{id}", "tenant"),
    Page("POST", "/tenants/{id}", "update_tenant"),
    Page("POST", "/tenants/{id}/delete", "delete_tenant"),
    Page("POST", "/tenants/{id}/keys", "create_key"),
    Page("POST", "/keys/{key_id}/rotate", "rotate_key"),
    Page("POST", "/keys/{key_id}/revoke", "revoke_key"),
    Page("GET", "/tenants/{id}/usage", "usage"),
    Page("GET", "/sessions/{id}", "session"),
    Page("GET", "/events", "events"),
    Page("GET", "/tiers", "tiers"),
    Page("GET", "/audit", "audit"),
)
OPEN = frozenset(PREFIX + p.path for p in PAGES if not p.login)


def see(path: str) -> web.Response:
    """A redirect after a POST (or to the login page): 303, so the browser GETs it."""
    return web.Response(status=303, headers={"Location": PREFIX + path})


def _spec_form(form: dict[str, str]) -> dict[str, Any]:
    """The fields of a tenant both forms have. A value left as typed when it is not a number:
    the spec's check names the field."""
    models = form.get("models", "").strip()
    return {
        "name": form.get("name", ""),
        "tier": form.get("tier", ""),
        "priority": _number(form.get("priority", "")),
        "models": "*" if models == "*" else [m.strip() for m in models.split(",") if m.strip()],
        "cache_group": form.get("cache_group", "").strip() or None,
    }


def _limits_form(form: dict[str, str], current: Tenant) -> dict[str, Any]:
    """The tenant's own limits and budgets as the edit form states them; an empty field: none.
    A money budget keeps the percentages its soft limits alert at (the API sets them)."""

    def field(name: str) -> str:
        return form.get(name, "").strip()

    limits = {k: _number(field(k)) for k in ("rpm", "tpm") if field(k)}
    budget = (
        {"tokens": _number(field("budget_tokens")), "per": field("budget_per") or "day"}
        if field("budget_tokens")
        else None
    )
    spend: dict[str, Any] | None = {
        p: field(f"spend_{p}") for p in ("day", "month") if field(f"spend_{p}")
    }
    if spend and current.spend is not None and current.spend.alert_at is not None:
        spend["alert_at"] = list(current.spend.alert_at)
    return {"limits": limits, "budget": budget, "spend": spend or None}


def _number(raw: str) -> int | str:
    return raw if (n := whole(raw)) is None else n


def money(micros: int | None) -> str:
    """An amount; none where records in several currencies do not add up (ledger/usage.py)."""
    return "–" if micros is None else f"{micros / 1e6:,.4f}"


class Console:
    def __init__(
        self,
        store: Store,
        reports: Reports,
        logins: Logins,
        overlap_s: float,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        breaker_states: BreakerStates | None = None,  # None: no Redis: not shown
    ) -> None:
        self.store = store
        self.reports = reports
        self.logins = logins
        self.overlap_s = overlap_s
        self.clock = clock
        self.breaker_states = breaker_states or BreakerStates(None)
        self.templates = jinja2.Environment(
            loader=jinja2.PackageLoader("admin", "templates"),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
        )
        self.templates.filters["money"] = money
        self.templates.globals["prefix"] = PREFIX

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware])
        for page in PAGES:
            app.router.add_route(page.method, page.path, getattr(self, page.handler))
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        response: web.StreamResponse
        try:
            response = await self._guarded(request, handler)
        except ApiError as exc:
            response = self._render(request, "error.j2", exc.status, message=exc.message)
        except web.HTTPException as exc:  # the router's 404 and 405
            response = self._render(request, "error.j2", exc.status, message=exc.reason)
        response.headers.update(HEADERS)
        return response

    async def _guarded(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in OPEN:
            sid = self.logins.session(request.cookies.get(COOKIE))
            if sid is None:
                return see("/")
            request[SID] = sid
            if request.method == "POST":
                given = (await self._form(request)).get("csrf", "")
                if not self.logins.csrf_ok(sid, given):
                    message = "this form's CSRF token is missing or wrong: reload the page"
                    return self._render(request, "error.j2", 403, message=message)
        return await handler(request)

    def _render(
        self, request: web.Request, name: str, status: int = 200, **ctx: Any
    ) -> web.Response:
        sid = request.get(SID)
        csrf = self.logins.csrf(sid) if sid is not None else ""
        text = self.templates.get_template(name).render(csrf=csrf, logged_in=sid is not None, **ctx)
        return web.Response(text=text, status=status, content_type="text/html")

    @staticmethod
    async def _form(request: web.Request) -> dict[str, str]:
        return {k: v for k, v in (await request.post()).items() if isinstance(v, str)}

    # Logging in and out.

    async def home(self, request: web.Request) -> web.Response:
        if self.logins.session(request.cookies.get(COOKIE)) is not None:
            return see("/tenants")
        return self._render(request, "login.j2")

    async def login(self, request: web.Request) -> web.Response:
        cookie = self.logins.start((await self._form(request)).get("token", ""))
        if cookie is None:
            return self._render(request, "login.j2", 401, error="wrong admin token")
        response = see("/tenants")
        response.set_cookie(
            COOKIE,
            cookie,
            path=PREFIX,
            max_age=int(LIFETIME_S),
            httponly=True,
            samesite="Strict",
            secure=request.secure,
        )
        return response

    async def logout(self, request: web.Request) -> web.Response:
        self.logins.end(request[SID])
        response = see("/")
        response.del_cookie(COOKIE, path=PREFIX)
        return response

    # Tenants and keys.

    async def tenants(self, request: web.Request) -> web.Response:
        page = await self.store.tenants(PageRequest(LIST, request.query.get("after")))
        tiers = sorted(self.store.tiers().all_tiers)
        return self._render(request, "tenants.j2", page=page, tiers=tiers)

    async def create_tenant(self, request: web.Request) -> web.Response:
        form = await self._form(request)
        body = {"id": form.get("id", "").strip(), **_spec_form(form)}
        row = await self.store.create_tenant(new_tenant(body, self.store.tiers()))
        return see(f"/tenants/{quote(row.spec.id)}")

    async def update_tenant(self, request: web.Request) -> web.Response:
        """The edit form: every field of the spec but its ID, limits and budgets included (an
        empty one: none, the tier's applies)."""
        tenant_id = request.match_info["id"]
        form = await self._form(request)
        current = (await self.store.tenant(tenant_id)).spec
        body = {**_spec_form(form), **_limits_form(form, current)}
        await self.store.update_tenant(tenant_id, body)
        return see(f"/tenants/{quote(tenant_id)}")

    async def delete_tenant(self, request: web.Request) -> web.Response:
        await self.store.delete_tenant(request.match_info["id"])
        return see("/tenants")

    async def tenant(self, request: web.Request) -> web.Response:
        return await self._tenant_page(request, request.match_info["id"])

    async def _tenant_page(
        self, request: web.Request, tenant_id: str, secret: str = "", made: KeyRow | None = None
    ) -> web.Response:
        row = await self.store.tenant(tenant_id)
        keys = await self.store.keys(tenant_id, PageRequest(MAX_LIMIT))
        spec = json.dumps(row.view(), indent=2)
        states, unknown = await self._breakers([row])
        return self._render(
            request,
            "tenant.j2",
            tenant=row,
            spec=spec,
            keys=keys,
            secret=secret,
            made=made,
            breaker=states[0] if states else None,
            breaker_unknown=unknown,
            # The tenant's own tier is offered even when the table lost it (a save then names
            # it and is refused), so that a save never moves a tenant to another tier unasked.
            tiers=sorted(self.store.tiers().all_tiers),
            units=[u.value for u in Unit][::-1],  # day first: the default
        )

    async def _breakers(self, rows: list[TenantRow]) -> tuple[list[BreakerState], str]:
        """The breakers of `rows` now, or none and why (no Redis, Redis down): the page
        shows the rest."""
        try:
            return await self.breaker_states.read(rows, self.store.tiers()), ""
        except ApiError as exc:
            return [], exc.message

    async def create_key(self, request: web.Request) -> web.Response:
        raw = (await self._form(request)).get("expires_days", "").strip()
        expires = None
        if raw:
            days = whole(raw)
            if days is None or not 1 <= days <= MAX_KEY_DAYS:
                raise ApiError.invalid("expires_days", f"a whole number of days, 1-{MAX_KEY_DAYS}")
            expires = self.clock() + timedelta(days=days)
        secret, key = await self.store.create_key(request.match_info["id"], expires)
        return await self._tenant_page(request, key.tenant, secret, key)

    async def rotate_key(self, request: web.Request) -> web.Response:
        secret, key, _ = await self.store.rotate_key(request.match_info["key_id"], self.overlap_s)
        return await self._tenant_page(request, key.tenant, secret, key)

    async def revoke_key(self, request: web.Request) -> web.Response:
        key = await self.store.revoke_key(request.match_info["key_id"])
        return see(f"/tenants/{quote(key.tenant)}")

    # What the ledger recorded.

    async def usage(self, request: web.Request) -> web.Response:
        tenant = await self.store.tenant(request.match_info["id"])
        first = days_back(self.clock(), DAYS)
        window = Window(tenant.spec.id, first)
        every = PageRequest(MAX_LIMIT)
        days = (await self.reports.usage(window, "day", every)).data
        models = (await self.reports.usage(window, "model", every)).data
        recent = await self.reports.sessions(tenant.spec.id, first, SESSIONS, RECENT_ROWS)
        by_day = {d["day"]: d for d in days}
        dates = [(first.date() + timedelta(days=i)).isoformat() for i in range(DAYS)]
        # None: no priced record that day (ledger/usage.py); several: listed, never summed.
        named = (d["currency"] or "" for d in days)
        currency = ",".join(sorted({c for text in named for c in text.split(",") if c}))
        cost = [(d, (by_day[d]["cost_micros"] or 0) / 1e6 if d in by_day else 0.0) for d in dates]
        requests = [(d, float(by_day[d]["requests"]) if d in by_day else 0.0) for d in dates]
        return self._render(
            request,
            "usage.j2",
            tenant=tenant,
            days=days,
            models=models,
            sessions=recent.sessions,
            partial=recent.partial,
            scanned=RECENT_ROWS,
            currency=currency,
            cost_chart=charts.columns(cost, currency or "(unpriced)", "cost"),
            requests_chart=charts.columns(requests, "requests", "requests"),
        )

    async def session(self, request: web.Request) -> web.Response:
        session_id = request.match_info["id"]
        after = request.query.get("after")
        page = await self.reports.session(session_id, PageRequest(TIMELINE, after))
        found = page.data
        if not found:  # `after` its last request
            raise ApiError(404, f"no request of {session_id!r} after {after!r}", "not_found")
        start = found[0]["ts"]
        rows = [
            self._stages(i, r, (r["ts"] - start).total_seconds() * 1000)
            for i, r in enumerate(found, 1)
        ]
        timeline = charts.bars(rows, "ms")
        return self._render(
            request,
            "session.j2",
            session=session_id,
            requests=found,
            timeline=timeline,
            page=page,
            after=after,
        )

    @staticmethod
    def _stages(n: int, r: dict[str, Any], at_ms: float) -> charts.Row:
        """A request's stages from its start (when Envoy got its first byte): the queue in flow
        control, prefill until its first byte went out (TTFT counts from the start, so the queue
        is in it), decode until its end. No first byte: its whole time is one `unanswered`."""
        queue = r["queue_ms"] or 0.0
        ttft = r["ttft_ms"]
        duration = r["duration_ms"]
        spans: tuple[charts.Span, ...]
        if ttft is None:
            spans = (
                charts.Span(at_ms, queue, "queue"),
                charts.Span(at_ms + queue, max(duration - queue, 0.0), "unanswered"),
            )
        else:
            spans = (
                charts.Span(at_ms, queue, "queue"),
                charts.Span(at_ms + queue, max(ttft - queue, 0.0), "prefill"),
                charts.Span(at_ms + max(ttft, queue), max(duration - ttft, 0.0), "decode"),
            )
        label = f"#{n} {r['pod'] or 'no pod'}"
        return charts.Row(label, spans, f"#{n} {r['request_id']}")

    async def audit(self, request: web.Request) -> web.Response:
        after = request.query.get("after")
        if after is not None and whole(after) is None:
            raise ApiError.invalid("after", "the last ID of a page of this list")
        page = await self.store.audit(PageRequest(LIST, after))
        return self._render(request, "audit.j2", page=page)

    async def events(self, request: web.Request) -> web.Response:
        after: dict[str, str | None] = {}
        for kind in ("breaker", "alert"):
            raw = request.query.get(f"{kind}_after")
            if raw is not None and whole(raw) is None:
                raise ApiError.invalid(f"{kind}_after", "the last ID of a page of this list")
            after[kind] = raw
        tenant = request.query.get("tenant") or None
        breakers = await self.reports.events(
            "breaker.", tenant, PageRequest(LIST, after["breaker"])
        )
        alerts = await self.reports.events("alert.", tenant, PageRequest(LIST, after["alert"]))
        # Tripped now: among a page of tenants by ID (bounded, as the API's breakers/open).
        scanned = await self.store.tenants(PageRequest(LIST, request.query.get("open_after")))
        states, unknown = await self._breakers(scanned.data)
        tripped = [s for s in states if s.state != "closed"]
        return self._render(
            request,
            "events.j2",
            breakers=breakers,
            alerts=alerts,
            tenant=tenant,
            tripped=tripped,
            scanned=scanned,
            tripped_unknown=unknown,
        )

    async def tiers(self, request: web.Request) -> web.Response:
        now = self.clock()
        table = self.store.tiers()
        hour = {t["tier"]: t for t in await self.reports.tiers(now - timedelta(hours=1))}
        day = {t["tier"]: t for t in await self.reports.tiers(now - timedelta(days=1))}
        names = sorted(set(table.all_tiers) | set(day))
        rows = [self._tokens(name, day[name]) for name in names if name in day]
        return self._render(
            request,
            "tiers.j2",
            names=names,
            specs=table.all_tiers,
            hour=hour,
            day=day,
            chart=charts.bars(rows, "tokens"),
        )

    @staticmethod
    def _tokens(tier: str, totals: dict[str, Any]) -> charts.Row:
        """A tier's charged tokens, with what it drew from the borrowing pool apart (the draw is
        never refunded, so it can exceed what settlement left charged)."""
        borrowed = totals["borrowed_tokens"] or 0
        own = max((totals["charged_tokens"] or 0) - borrowed, 0)
        spans = (charts.Span(0, own, "own"), charts.Span(own, borrowed, "borrowed"))
        return charts.Row(tier or "(none)", spans, tier)
