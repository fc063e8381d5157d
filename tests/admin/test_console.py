"""The web console (admin/console.py) over real HTTP against a real PostgreSQL: its logins, its
CSRF tokens, its escaping, its forms and what its pages show of the ledger's rows."""

from __future__ import annotations

import hashlib
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from html.parser import HTMLParser
from typing import Any

import aiohttp
import pytest

from admin import console
from admin.console import PAGES, PREFIX, Page
from admin.logins import COOKIE
from tests.admin.conftest import Api
from tests.admin.test_reports import outcome, write

GUARDED = [p for p in PAGES if p.login]
FORMS = [p for p in GUARDED if p.method == "POST"]
CSRF = re.compile(r'name="csrf" value="([^"]+)"')
SECRET = re.compile(r'<code id="secret">([^<]+)</code>')
RECT = re.compile(
    r'<rect class="(\w+)" x="([\d.]+)" y="([\d.]+)" width="([\d.]+)" height="([\d.]+)"'
)


def concrete(page: Page) -> str:
    return PREFIX + re.sub(r"{\w+}", "x", page.path)


@dataclass
class Reply:
    status: int
    text: str
    headers: Any  # the multidict: Set-Cookie may repeat


@dataclass
class Browser:
    """A client of the console with a cookie jar, as a browser is; no redirect followed."""

    api: Api
    session: aiohttp.ClientSession

    async def get(self, path: str, **query: str) -> Reply:
        async with self.session.get(self.api.url + path, params=query, allow_redirects=False) as r:
            return Reply(r.status, await r.text(), r.headers)

    async def post(self, path: str, form: dict[str, str] | None = None) -> Reply:
        async with self.session.post(
            self.api.url + path, data=form or {}, allow_redirects=False
        ) as r:
            return Reply(r.status, await r.text(), r.headers)

    async def login(self, token: str | None = None) -> Reply:
        return await self.post(
            f"{PREFIX}/login", {"token": self.api.token if token is None else token}
        )

    async def csrf(self) -> str:
        found = CSRF.search((await self.get(f"{PREFIX}/tenants")).text)
        assert found is not None
        return found.group(1)

    async def submit(self, path: str, form: dict[str, str] | None = None) -> Reply:
        """A form posted as the page sends it: with its CSRF token."""
        return await self.post(path, {**(form or {}), "csrf": await self.csrf()})


@pytest.fixture
async def browser(api: Api) -> AsyncIterator[Browser]:
    jar = aiohttp.CookieJar(unsafe=True)  # cookies of 127.0.0.1, as a browser keeps them
    async with aiohttp.ClientSession(cookie_jar=jar) as session:
        yield Browser(api, session)


@pytest.fixture
async def logged_in(browser: Browser) -> Browser:
    assert (await browser.login()).status == 303
    return browser


def cookie_of(reply: Reply) -> str:
    (header,) = [h for h in reply.headers.getall("Set-Cookie") if h.startswith(COOKIE + "=")]
    return str(header)


def redirected_to_login(reply: Reply) -> bool:
    return reply.status == 303 and reply.headers["Location"] == f"{PREFIX}/"


@pytest.mark.parametrize("page", GUARDED, ids=lambda p: f"{p.method} {p.path}")
async def test_every_console_page_needs_a_login(browser: Browser, page: Page) -> None:
    send = browser.get if page.method == "GET" else browser.post
    assert redirected_to_login(await send(concrete(page)))
    browser.session.cookie_jar.update_cookies({COOKIE: "forged.0000"})
    assert redirected_to_login(await send(concrete(page)))


async def test_the_login_page_and_a_wrong_token_refused(browser: Browser) -> None:
    assert 'name="token"' in (await browser.get(f"{PREFIX}/")).text
    for wrong in ("", "x" * 64, browser.api.token[:-1], browser.api.token + "x"):
        reply = await browser.login(wrong)
        assert reply.status == 401 and "wrong admin token" in reply.text
        assert "Set-Cookie" not in reply.headers
    assert redirected_to_login(await browser.get(f"{PREFIX}/tenants"))


async def test_the_cookie_is_a_session_not_the_token_http_only_and_strict(browser: Browser) -> None:
    reply = await browser.login()
    assert reply.status == 303 and reply.headers["Location"] == f"{PREFIX}/tenants"
    header = cookie_of(reply)
    value = header.split(";")[0].split("=", 1)[1]
    assert browser.api.token not in header and len(value) > 40
    attributes = {a.strip().split("=")[0].lower(): a for a in header.split(";")[1:]}
    assert "httponly" in attributes and "samesite" in attributes
    assert attributes["samesite"].strip() == "SameSite=Strict"
    assert attributes["path"].strip() == f"Path={PREFIX}"
    assert "secure" not in attributes  # plain HTTP here: a Secure cookie would never come back
    assert (await browser.get(f"{PREFIX}/tenants")).status == 200
    assert (await browser.get(f"{PREFIX}/")).headers["Location"] == f"{PREFIX}/tenants"
    # A second login is another session: the cookie is not a function of the token.
    other = cookie_of(await browser.login())
    assert other.split(";")[0] != header.split(";")[0]
    # Logging out forgets the session: its cookie, replayed, no longer logs in.
    assert redirected_to_login(await browser.submit(f"{PREFIX}/logout"))
    browser.session.cookie_jar.update_cookies({COOKIE: other.split(";")[0].split("=", 1)[1]})
    assert redirected_to_login(await browser.get(f"{PREFIX}/tenants"))


@pytest.mark.parametrize("page", FORMS, ids=lambda p: f"{p.method} {p.path}")
async def test_every_form_needs_its_csrf_token(logged_in: Browser, page: Page) -> None:
    api = logged_in.api
    await api.tenant("acme")
    made = await api.ok("POST", "/admin/v1/tenants/acme/keys", {})
    path = PREFIX + page.path.replace("{id}", "acme").replace("{key_id}", made["id"])
    form = {"id": "beta", "name": "Beta", "tier": "standard", "priority": "5", "models": "*"}
    right = await logged_in.csrf()
    wrong = right[:-1] + ("1" if right.endswith("0") else "0")
    for sent in (form, {**form, "csrf": ""}, {**form, "csrf": wrong}):
        reply = await logged_in.post(path, sent)
        assert reply.status == 403 and "CSRF" in reply.text, (sent, reply.status)
    # Nothing happened: no tenant, no key, the key neither rotated nor revoked, still logged in.
    assert [t["id"] for t in (await api.ok("GET", "/admin/v1/tenants"))["data"]] == ["acme"]
    keys = (await api.ok("GET", "/admin/v1/tenants/acme/keys"))["data"]
    assert [(k["id"], k["revoked"], k["expires"]) for k in keys] == [(made["id"], False, None)]
    assert (await logged_in.get(f"{PREFIX}/tenants")).status == 200


async def test_tenant_supplied_text_is_escaped(logged_in: Browser) -> None:
    script = "<script>alert(1)</script>"
    await logged_in.api.tenant("acme", name=script, models=[f"m{script}"])
    now = datetime.now(UTC)
    await write(logged_in.api, [outcome(0, ts=now, model=script, session="s1", pod=script)])
    for path in ("/tenants", "/tenants/acme", "/tenants/acme/usage", "/sessions/s1"):
        reply = await logged_in.get(PREFIX + path)
        assert "<script" not in reply.text, path
        assert "&lt;script&gt;" in reply.text, path
        # Were a page to slip, no script would run: the policy names no script source.
        policy = reply.headers["Content-Security-Policy"]
        assert "default-src 'none'" in policy and "script-src" not in policy
        assert reply.headers["Cache-Control"] == "no-store"  # a key's secret is never cached


async def test_a_tenant_and_a_key_made_in_the_forms_show_the_key_once(logged_in: Browser) -> None:
    api = logged_in.api
    form = {"id": "acme", "name": "Acme", "tier": "standard", "priority": "7", "models": "a, b"}
    reply = await logged_in.submit(f"{PREFIX}/tenants", form)
    assert reply.status == 303 and reply.headers["Location"] == f"{PREFIX}/tenants/acme"
    spec = await api.ok("GET", "/admin/v1/tenants/acme")
    assert (spec["name"], spec["priority"], spec["models"]) == ("Acme", 7, ["a", "b"])
    assert "Acme" in (await logged_in.get(f"{PREFIX}/tenants")).text
    bad = await logged_in.submit(f"{PREFIX}/tenants", {**form, "id": "beta", "tier": "nope"})
    assert bad.status == 400 and "unknown tier" in bad.text

    made = await logged_in.submit(f"{PREFIX}/tenants/acme/keys")
    assert made.status == 200
    found = SECRET.search(made.text)
    assert found is not None
    secret = found.group(1)
    (row,) = await api.rows("SELECT id, sha256 FROM api_keys WHERE tenant = 'acme'")
    assert row["sha256"] == hashlib.sha256(secret.encode()).hexdigest()
    again = (await logged_in.get(f"{PREFIX}/tenants/acme")).text
    assert secret not in again and row["id"] in again and "active" in again

    rotated = await logged_in.submit(f"{PREFIX}/keys/{row['id']}/rotate")
    found = SECRET.search(rotated.text)
    assert rotated.status == 200 and found is not None and found.group(1) != secret
    keys = {k["id"]: k for k in (await api.ok("GET", "/admin/v1/tenants/acme/keys"))["data"]}
    assert len(keys) == 2 and keys[row["id"]]["expires"] is not None

    revoked = await logged_in.submit(f"{PREFIX}/keys/{row['id']}/revoke")
    assert revoked.status == 303 and revoked.headers["Location"] == f"{PREFIX}/tenants/acme"
    keys = {k["id"]: k for k in (await api.ok("GET", "/admin/v1/tenants/acme/keys"))["data"]}
    assert keys[row["id"]]["revoked"] and not any(
        k["revoked"] for k in keys.values() if k["id"] != row["id"]
    )
    page = (await logged_in.get(f"{PREFIX}/tenants/acme")).text
    key_row = page.split(f'id="key-{row["id"]}"')[1].split("</tr>")[0]
    assert "revoked" in key_row and "Revoke" not in key_row
    missing = await logged_in.submit(f"{PREFIX}/keys/nope/revoke")
    assert missing.status == 404 and "no key" in missing.text


async def test_the_edit_form_sets_and_clears_a_tenants_limits_and_budgets(
    logged_in: Browser,
) -> None:
    """Every field of the spec but its ID, the tenant's own limits and budgets among them, as
    the API then shows them; an empty one clears it (the tier's applies); a bad one is a 400
    naming the field, and changes nothing."""
    api = logged_in.api
    form = {"id": "acme", "name": "Acme", "tier": "standard", "priority": "7", "models": "*"}
    assert (await logged_in.submit(f"{PREFIX}/tenants", form)).status == 303
    edit = {
        "name": "Acme Inc", "tier": "free", "priority": "3", "models": "a, b",
        "cache_group": "acme-group", "rpm": "60", "tpm": "9000",
        "budget_tokens": "50000", "budget_per": "hour", "spend_day": "2.5", "spend_month": "40",
    }  # fmt: skip
    saved = await logged_in.submit(f"{PREFIX}/tenants/acme", edit)
    assert saved.status == 303 and saved.headers["Location"] == f"{PREFIX}/tenants/acme"
    spec = await api.ok("GET", "/admin/v1/tenants/acme")
    assert (spec["name"], spec["tier"], spec["priority"], spec["models"]) == (
        "Acme Inc", "free", 3, ["a", "b"],
    )  # fmt: skip
    assert spec["cache_group"] == "acme-group"
    assert spec["limits"] == {"rpm": 60, "tpm": 9000}
    assert spec["budget"] == {"tokens": 50000, "per": "hour"}
    assert spec["spend"] == {"day": "2.5", "month": "40", "alert_at": None}  # the tier's
    page = (await logged_in.get(f"{PREFIX}/tenants/acme")).text
    assert 'name="budget_tokens" type="number" min="0" value="50000"' in page
    assert 'name="spend_day" value="2.5"' in page
    # The percentages the API set are kept by the form.
    await api.ok("PATCH", "/admin/v1/tenants/acme", {"spend": {"day": "2.5", "alert_at": [90]}})
    assert (await logged_in.submit(f"{PREFIX}/tenants/acme", edit)).status == 303
    spec = await api.ok("GET", "/admin/v1/tenants/acme")
    assert spec["spend"]["alert_at"] == [90]
    bad = await logged_in.submit(f"{PREFIX}/tenants/acme", {**edit, "spend_day": "lots"})
    assert bad.status == 400 and "spend.day" in bad.text
    bad = await logged_in.submit(f"{PREFIX}/tenants/acme", {**edit, "rpm": "-1"})
    assert bad.status == 400 and "limits.rpm" in bad.text
    assert (await api.ok("GET", "/admin/v1/tenants/acme"))["limits"]["rpm"] == 60
    cleared = {k: v for k, v in edit.items() if k in ("name", "tier", "priority", "models")}
    assert (await logged_in.submit(f"{PREFIX}/tenants/acme", cleared)).status == 303
    spec = await api.ok("GET", "/admin/v1/tenants/acme")
    assert (spec["limits"], spec["budget"], spec["spend"], spec["cache_group"]) == (
        {"rpm": None, "tpm": None}, None, None, None,
    )  # fmt: skip


class FormValues(HTMLParser):
    """What a browser submits for the form with id `form_id`: inputs' values, each select's
    selected option or else its first."""

    def __init__(self, form_id: str) -> None:
        super().__init__()
        self.form_id, self.inside, self.values = form_id, False, {}
        self.select: str | None = None
        self.first: str | None = None
        self.chosen: str | None = None
        self.option_selected = False
        self.text = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "form":
            self.inside = a.get("id") == self.form_id
        if not self.inside:
            return
        if tag == "input" and a.get("name"):
            self.values[a["name"]] = a.get("value") or ""
        elif tag == "select":
            self.select, self.first, self.chosen = a["name"], None, None
        elif tag == "option":
            self.option_selected, self.text = "selected" in a, ""

    def handle_data(self, data: str) -> None:
        self.text += data

    def handle_endtag(self, tag: str) -> None:
        if tag == "form":
            self.inside = False
        if not self.inside:
            return
        if tag == "option" and self.select:
            if self.first is None:
                self.first = self.text
            if self.option_selected:
                self.chosen = self.text
        elif tag == "select" and self.select:
            self.values[self.select] = self.chosen if self.chosen is not None else self.first
            self.select = None


async def test_the_edit_form_saved_unchanged_changes_nothing(logged_in: Browser) -> None:
    """Submitted as a browser submits it (each select's selected option, else its first): a
    budget per second stays per second, the alert percentages the API set stay, and a tier the
    table no longer has is refused, never swapped for another."""
    api = logged_in.api
    spec = {
        "id": "acme", "name": "Acme", "tier": "standard", "priority": 5,
        "models": ["m1", "m2"], "cache_group": "g1", "limits": {"rpm": 10, "tpm": 5000},
        "budget": {"tokens": 1000, "per": "second"},
        "spend": {"month": "12.5", "alert_at": [90]},
    }  # fmt: skip
    await api.ok("POST", "/admin/v1/tenants", spec)
    before = await api.ok("GET", "/admin/v1/tenants/acme")
    form = FormValues("edit-tenant")
    form.feed((await logged_in.get(f"{PREFIX}/tenants/acme")).text)
    saved = await logged_in.post(f"{PREFIX}/tenants/acme", form.values)
    assert saved.status == 303, form.values
    after = await api.ok("GET", "/admin/v1/tenants/acme")
    assert {k: v for k, v in after.items() if before[k] != v} == {}
    removed = {**form.values, "tier": "gone"}  # what the form offers for a tier since removed
    refused = await logged_in.post(f"{PREFIX}/tenants/acme", removed)
    assert refused.status == 400 and "unknown tier" in refused.text
    page = (await logged_in.get(f"{PREFIX}/tenants/acme")).text
    assert "<option selected>standard</option>" in page


async def test_a_key_made_with_an_expiry_and_a_tenant_deleted_in_the_console(
    logged_in: Browser,
) -> None:
    api = logged_in.api
    form = {"id": "acme", "name": "Acme", "tier": "standard", "priority": "7", "models": "*"}
    assert (await logged_in.submit(f"{PREFIX}/tenants", form)).status == 303
    made = await logged_in.submit(f"{PREFIX}/tenants/acme/keys", {"expires_days": "30"})
    assert made.status == 200 and SECRET.search(made.text) is not None
    (key,) = (await api.ok("GET", "/admin/v1/tenants/acme/keys"))["data"]
    expires = datetime.fromisoformat(key["expires"])
    assert timedelta(days=29) < expires - datetime.now(UTC) <= timedelta(days=30)
    for days in ("0", "x", "3651"):
        bad = await logged_in.submit(f"{PREFIX}/tenants/acme/keys", {"expires_days": days})
        assert bad.status == 400 and "expires_days" in bad.text
    assert len((await api.ok("GET", "/admin/v1/tenants/acme/keys"))["data"]) == 1
    gone = await logged_in.submit(f"{PREFIX}/tenants/acme/delete")
    assert gone.status == 303 and gone.headers["Location"] == f"{PREFIX}/tenants"
    assert (await api.call("GET", "/admin/v1/tenants/acme")).status == 404
    (revoked,) = await api.rows("SELECT revoked FROM api_keys WHERE tenant = 'acme'")
    assert revoked["revoked"]
    assert "acme" not in (await logged_in.get(f"{PREFIX}/tenants")).text


async def test_the_audit_page_lists_every_change_and_never_a_key(logged_in: Browser) -> None:
    form = {"id": "acme", "name": "Acme", "tier": "standard", "priority": "7", "models": "*"}
    assert (await logged_in.submit(f"{PREFIX}/tenants", form)).status == 303
    made = await logged_in.submit(f"{PREFIX}/tenants/acme/keys")
    found = SECRET.search(made.text)
    assert found is not None
    assert (await logged_in.submit(f"{PREFIX}/tenants/acme", {**form, "rpm": "5"})).status == 303
    page = (await logged_in.get(f"{PREFIX}/audit")).text
    rows = page.split('id="audit"')[1]
    actions = re.findall(r"<td>(tenant\.\w+|key\.\w+)</td>", rows)
    assert actions == ["tenant.create", "key.create", "tenant.update"], actions
    assert found.group(1) not in page
    assert (await logged_in.get(f"{PREFIX}/audit", after="x")).status == 400


async def test_the_usage_page_shows_the_ledgers_rows(logged_in: Browser) -> None:
    await logged_in.api.tenant("acme")
    today = datetime.now(UTC).replace(hour=0, minute=0, second=1, microsecond=0)
    yesterday = today - timedelta(days=1)
    rows = [
        outcome(0, ts=today, session="s-old", cost_micros=1_500_000),
        outcome(1, ts=today, session="s-new", cost_micros=2_000_000, model="m2"),
        outcome(2, ts=yesterday, session="s-old", cost_micros=500_000),
        outcome(3, ts=today, tenant="beta", cost_micros=9_000_000),  # another tenant's
        outcome(4, ts=today - timedelta(days=40), cost_micros=7_000_000),  # outside the 30 days
    ]
    await write(logged_in.api, rows)
    page = (await logged_in.get(f"{PREFIX}/tenants/acme/usage")).text
    days = page.split('id="days"')[1].split("</table>")[0]
    assert f'<td>{today.date().isoformat()}</td><td class="n">2</td>' in days
    assert f'<td>{yesterday.date().isoformat()}</td><td class="n">1</td>' in days
    assert "3.5000 USD" in days and "0.5000 USD" in days and "9.0000" not in page
    assert "7.0000" not in page
    costs = [float(h) for kind, _, _, _, h in RECT.findall(page) if kind == "cost"]
    assert (
        len(costs) == 30
        and costs[-1] == max(costs)
        and costs[-2] == pytest.approx(costs[-1] / 7, abs=0.2)
    )
    sessions = re.findall(r'<a class="session" href="([^"]+)">', page)
    assert sessions == [f"{PREFIX}/sessions/s-new", f"{PREFIX}/sessions/s-old"]


async def test_the_usage_page_of_unpriced_or_mixed_currency_records(logged_in: Browser) -> None:
    """Records no price table priced (no currency), or priced in two currencies: the page
    shows their requests, and no sum of money that does not add up."""
    await logged_in.api.tenant("acme")
    today = datetime.now(UTC).replace(hour=0, minute=0, second=1, microsecond=0)
    await write(logged_in.api, [outcome(0, ts=today, currency="", cost_micros=0)])
    unpriced = await logged_in.get(f"{PREFIX}/tenants/acme/usage")
    assert unpriced.status == 200 and "None" not in unpriced.text
    await write(logged_in.api, [outcome(1, ts=today, currency="EUR"), outcome(2, ts=today)])
    mixed = (await logged_in.get(f"{PREFIX}/tenants/acme/usage")).text
    days = mixed.split('id="days"')[1].split("</table>")[0]
    assert f'<td>{today.date().isoformat()}</td><td class="n">3</td>' in days
    assert "– EUR,USD" in days


async def test_the_session_timeline_lists_its_requests_in_order_with_their_stages(
    logged_in: Browser,
) -> None:
    t0 = datetime.now(UTC)
    at = [t0 + timedelta(milliseconds=ms) for ms in (0, 1000, 2000)]
    rows = [  # written out of order; the third never got a first byte
        outcome(
            2,
            ts=at[2],
            session="s1",
            pod="p2",
            ttft_ms=None,
            duration_ms=500.0,
            outcome="upstream_error",
            status=503,
        ),
        outcome(
            0, ts=at[0], session="s1", pod="p1", queue_ms=100.0, ttft_ms=300.0, duration_ms=900.0
        ),
        outcome(
            1, ts=at[1], session="s1", pod="p2", queue_ms=0.0, ttft_ms=200.0, duration_ms=400.0
        ),
        outcome(3, ts=at[0], session="s2"),
    ]
    await write(logged_in.api, rows)
    page = (await logged_in.get(f"{PREFIX}/sessions/s1")).text
    table = page.split('id="requests"')[1]
    assert re.findall(r"<td>(req-\d+)</td>", table) == ["req-0000", "req-0001", "req-0002"]
    cells = re.findall(r'<td class="n (queue|ttft|decode)-ms">([^<]+)</td>', table)
    assert [v for _, v in cells] == [
        "100.0",
        "300.0",
        "600.0",
        "0.0",
        "200.0",
        "200.0",
        "—",
        "—",
        "—",
    ]
    rects = [(k, float(x), float(y), float(w)) for k, x, y, w, _ in RECT.findall(page)]
    by_row = {y: [(k, x, w) for k, x, yy, w in rects if yy == y] for _, _, y, _ in rects}
    first, second, third = (by_row[y] for y in sorted(by_row))
    assert [k for k, _, _ in first] == ["queue", "prefill", "decode"]
    (_, qx, qw), (_, px, pw), (_, dx, dw) = first
    assert px == pytest.approx(qx + qw, abs=0.2) and dx == pytest.approx(px + pw, abs=0.2)
    assert pw == pytest.approx(2 * qw, abs=0.5) and dw == pytest.approx(6 * qw, abs=0.5)
    assert [k for k, _, _ in second] == ["prefill", "decode"]  # no time in the queue
    assert second[0][1] == pytest.approx(qx + 10 * qw, abs=0.5)  # one second after the first
    assert [k for k, _, _ in third] == ["unanswered"]
    assert (await logged_in.get(f"{PREFIX}/sessions/nope")).status == 404


async def test_a_long_session_shows_a_page_of_its_requests_and_links_the_next(
    logged_in: Browser, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session of more requests than a page (console.TIMELINE, 3 here) shows the first ones,
    says so and links the rest, in order across requests of one instant."""
    monkeypatch.setattr(console, "TIMELINE", 3)
    t0 = datetime.now(UTC)
    at = [t0, t0, t0 + timedelta(seconds=1), t0 + timedelta(seconds=1), t0 + timedelta(seconds=2)]
    stages = {"ttft_ms": 10.0, "duration_ms": 30.0}
    await write(
        logged_in.api, [outcome(i, ts=ts, session="s1", **stages) for i, ts in enumerate(at)]
    )

    def requests(page: str) -> list[str]:
        return re.findall(r"<td>(req-\d+)</td>", page.split('id="requests"')[1])

    first = (await logged_in.get(f"{PREFIX}/sessions/s1")).text
    assert requests(first) == ["req-0000", "req-0001", "req-0002"]
    assert "The first 3 requests shown" in first
    assert len({y for _, _, y, _, _ in RECT.findall(first)}) == 3  # a bar each, no more
    link = re.search(r'<a id="next" href="([^"]+)"', first)
    assert link is not None and link.group(1) == "?after=req-0002"
    rest = (await logged_in.get(f"{PREFIX}/sessions/s1", after="req-0002")).text
    assert requests(rest) == ["req-0003", "req-0004"]
    assert "2 requests after <code>req-0002</code> shown." in rest and 'id="next"' not in rest
    past = await logged_in.get(f"{PREFIX}/sessions/s1", after="req-0004")
    assert past.status == 404
    short = (await logged_in.get(f"{PREFIX}/sessions/s1", after="req-0001")).text
    assert requests(short) == ["req-0002", "req-0003", "req-0004"] and 'id="next"' not in short


async def test_recent_sessions_are_read_from_the_latest_requests_of_the_window(
    logged_in: Browser, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The usage page's recent sessions come from the tenant's latest requests in its 30 days
    (console.RECENT_ROWS of them, 3 here), never its whole history: an older session is not
    listed, and when the bound is reached the page says the counts are within it."""
    monkeypatch.setattr(console, "RECENT_ROWS", 3)
    await logged_in.api.tenant("acme")
    now = datetime.now(UTC)
    rows = [
        outcome(0, ts=now - timedelta(days=40), session="s-old"),  # before the window
        outcome(1, ts=now - timedelta(days=1), session="s-a"),
        outcome(2, ts=now - timedelta(days=1) + timedelta(seconds=1), session="s-a"),
        outcome(3, ts=now - timedelta(seconds=2), session="s-b"),
        outcome(4, ts=now - timedelta(seconds=1), session="s-b"),
        outcome(5, ts=now, tenant="beta", session="s-c"),  # another tenant's
    ]
    await write(logged_in.api, rows)
    page = (await logged_in.get(f"{PREFIX}/tenants/acme/usage")).text
    table = page.split('id="sessions"')[1].split("</table>")[0]
    found = re.findall(r'<a class="session" href="[^"]+">([^<]+)</a>', table)
    assert found == ["s-b", "s-a"]
    counts = re.findall(r'<td class="n">(\d+)</td>', table)
    assert counts == ["2", "1"]  # s-a's latest request only: within the 3 read
    assert 'id="partial"' in page and "latest 3 requests" in page
    monkeypatch.setattr(console, "RECENT_ROWS", 5)
    whole = (await logged_in.get(f"{PREFIX}/tenants/acme/usage")).text
    assert 'id="partial"' not in whole  # the window's 4, fewer than the bound: all read


async def test_the_events_and_tiers_pages_show_the_ledgers_rows(logged_in: Browser) -> None:
    await write(logged_in.api, [], [("breaker.trip", "acme"), ("alert.spend", "beta")])
    page = (await logged_in.get(f"{PREFIX}/events")).text
    breakers = page.split('id="breakers"')[1].split("</table>")[0]
    alerts = page.split('id="alerts"')[1].split("</table>")[0]
    assert "breaker.trip" in breakers and "acme" in breakers and "alert" not in breakers
    assert "alert.spend" in alerts and "beta" in alerts
    only = (await logged_in.get(f"{PREFIX}/events", tenant="beta")).text
    assert "breaker.trip" not in only and "alert.spend" in only
    now = datetime.now(UTC)
    await write(
        logged_in.api,
        [
            outcome(0, ts=now, tier="standard", charged_tokens=100, borrowed_tokens=40),
            outcome(1, ts=now - timedelta(hours=2), tier="standard", charged_tokens=50),
            outcome(2, ts=now - timedelta(days=2), tier="standard", charged_tokens=1000),
        ],
    )
    tiers = (await logged_in.get(f"{PREFIX}/tiers")).text
    row = tiers.split('id="tier-standard"')[1].split("</tr>")[0]
    numbers = re.findall(r'<td class="n">([^<]+)</td>', row)
    # limits (3), last hour: requests, refused, charged, borrowed; last day: tenants,
    # requests, refused, charged, borrowed (requests borrowing)
    assert numbers[3:] == ["1", "0", "100", "40", "1", "2", "0", "150", "40 (1)"]
    assert {k for k, *_ in RECT.findall(tiers)} == {"own", "borrowed"}
