"""Usage, sessions, breakers and alerts: what the ledger wrote (its own INSERTs, ledger/db.py),
read back through the admin API."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime, time, timedelta
from typing import Any

import asyncpg
import pytest

from admin.reports import Reports, Window
from admin.types import ApiError, PageRequest
from ledger.db import INSERT_EVENTS, INSERT_OUTCOMES, columns
from llmgw.outcome import Outcome
from tests.admin.conftest import Api, serve
from tests.admin.test_api import assert_error
from tests.eventually import eventually_awaited

# The admin's clock stands still at the module's import: the rows below are placed against it,
# and a suite that runs past midnight (UTC) must not move the default window under them.
NOW = datetime.now(UTC)
TODAY = NOW.date()
T0 = datetime.combine(TODAY - timedelta(days=2), time(23, 59, 58), UTC)  # in the default window
DAY0, DAY1 = (TODAY - timedelta(days=2)).isoformat(), (TODAY - timedelta(days=1)).isoformat()


@pytest.fixture
async def api(db: str) -> AsyncIterator[Api]:
    async with serve(db, clock=lambda: NOW) as running:
        yield running


def outcome(i: int, **fields: Any) -> Outcome:
    values: dict[str, Any] = {
        "request_id": f"req-{i:04d}",
        "ts": T0 + timedelta(seconds=i),
        "tenant": "acme",
        "model": "m1",
        "outcome": "ok",
        "status": 200,
        "prompt_tokens": 10,
        "completion_tokens": 5,
        "charged_tokens": 15,
        "cost_micros": 1_000,
        "currency": "USD",
    }
    return Outcome(**{**values, **fields})


async def write(api: Api, outcomes: list[Outcome], events: Sequence[tuple[str, str]] = ()) -> None:
    conn = await asyncpg.connect(api.database_url)
    try:
        if outcomes:
            await conn.execute(INSERT_OUTCOMES, *columns(outcomes))
        for i, (kind, tenant) in enumerate(events):
            at = [T0 + timedelta(seconds=i)]
            await conn.execute(INSERT_EVENTS, at, [kind], [tenant], [f'{{"n": {i}}}'])
    finally:
        await conn.close()


async def test_usage_by_tenant_model_and_day_within_a_window(api: Api) -> None:
    await write(
        api,
        [
            outcome(0),
            outcome(1, model="m2", gpu_seconds=0.5),
            outcome(2, outcome="upstream_error", status=503, charged_tokens=0, cost_micros=0),
            outcome(3, tenant="beta", cached_tokens=4),
        ],
    )
    by_tenant = await api.ok("GET", "/admin/v1/usage")
    acme, beta = by_tenant["data"]
    assert (acme["tenant"], beta["tenant"]) == ("acme", "beta")
    assert (acme["requests"], acme["errors"], acme["prompt_tokens"]) == (3, 1, 30)
    assert (acme["completion_tokens"], acme["charged_tokens"]) == (15, 30)
    assert acme["cost_micros"] == 2000
    assert acme["currency"] == "USD" and acme["gpu_seconds"] == 0.5
    assert beta["cached_tokens"] == 4
    models = await api.ok("GET", "/admin/v1/usage", group_by="model", tenant="acme")
    assert [(m["model"], m["requests"]) for m in models["data"]] == [("m1", 2), ("m2", 1)]
    days = await api.ok("GET", "/admin/v1/usage", group_by="day")  # 23:59:58 + 0..3 s
    assert [(d["day"], d["requests"]) for d in days["data"]] == [(DAY0, 2), (DAY1, 2)]
    since, until = (T0 + timedelta(seconds=1)).isoformat(), (T0 + timedelta(seconds=3)).isoformat()
    window = await api.ok("GET", "/admin/v1/usage", since=since, until=until)
    assert [(w["tenant"], w["requests"]) for w in window["data"]] == [("acme", 2)]
    naive = await api.ok("GET", "/admin/v1/usage", since=f"{DAY1}T00:00:00")  # UTC
    assert sum(w["requests"] for w in naive["data"]) == 2
    first = await api.ok("GET", "/admin/v1/usage", limit=1)
    assert first["has_more"] and first["last_id"] == "acme"
    rest = await api.ok("GET", "/admin/v1/usage", after="acme")
    assert [r["tenant"] for r in rest["data"]] == ["beta"] and not rest["has_more"]
    for query, param in (({"group_by": "pod"}, "group_by"), ({"since": "yesterday"}, "since")):
        reply = await api.call("GET", "/admin/v1/usage", **query)
        assert reply.status == 400
        assert_error(reply.body, "invalid_value", param)


async def test_usage_without_since_reads_the_last_30_days(api: Api) -> None:
    """No `since`: the last 30 UTC days, today's included (the console's window), up to
    `until` when given: a request older is not read unless `since` names it."""
    first = datetime.combine(TODAY - timedelta(days=29), time(), UTC)
    await write(
        api,
        [
            outcome(0, ts=first - timedelta(seconds=1), tenant="old"),
            outcome(1, ts=first, tenant="new"),
        ],
    )
    default = await api.ok("GET", "/admin/v1/usage")
    assert [r["tenant"] for r in default["data"]] == ["new"]
    earlier = (first - timedelta(days=1)).isoformat()
    both = await api.ok("GET", "/admin/v1/usage", since=earlier)
    assert [r["tenant"] for r in both["data"]] == ["new", "old"]
    before = await api.ok("GET", "/admin/v1/usage", until=first.isoformat())
    assert [r["tenant"] for r in before["data"]] == ["old"]
    # An `until` at midnight ends the day before: still 30 whole days, the 30th back included.
    midnight = datetime.combine(TODAY, time(), UTC)
    thirtieth = midnight - timedelta(days=30)
    await write(
        api,
        [
            outcome(2, ts=thirtieth, tenant="thirtieth"),
            outcome(3, ts=thirtieth - timedelta(seconds=1), tenant="thirty-first"),
            outcome(4, ts=midnight, tenant="today"),
        ],
    )
    ending = await api.ok("GET", "/admin/v1/usage", until=midnight.isoformat())
    assert [r["tenant"] for r in ending["data"]] == ["new", "old", "thirtieth"]


async def test_a_page_of_tenants_holds_those_with_requests_in_the_window(api: Api) -> None:
    """By tenant, a page is the next `limit` tenants with requests in the window: one with
    requests before it only (found on the way through the index) is passed over."""
    old = T0 - timedelta(days=60)
    await write(
        api,
        [
            outcome(0, tenant="a"),
            outcome(1, tenant="b", ts=old),
            outcome(2, tenant="c"),
            outcome(3, tenant="c"),
            outcome(4, tenant="d", ts=old),
        ],
    )
    page = await api.ok("GET", "/admin/v1/usage", limit=2)
    assert [(r["tenant"], r["requests"]) for r in page["data"]] == [("a", 1), ("c", 2)]
    assert not page["has_more"] and page["last_id"] == "c"
    first = await api.ok("GET", "/admin/v1/usage", limit=1)
    assert [r["tenant"] for r in first["data"]] == ["a"] and first["has_more"]
    rest = await api.ok("GET", "/admin/v1/usage", limit=1, after="a")
    assert [r["tenant"] for r in rest["data"]] == ["c"] and not rest["has_more"]
    assert (await api.ok("GET", "/admin/v1/usage", after="c"))["data"] == []


async def test_a_window_longer_than_366_days_is_a_400(api: Api) -> None:
    await write(api, [outcome(0)])
    now = datetime.now(UTC)
    year = await api.ok("GET", "/admin/v1/usage", since=(now - timedelta(days=365)).isoformat())
    assert [r["requests"] for r in year["data"]] == [1]
    long_ago = now - timedelta(days=800)
    for query in (
        {"since": (now - timedelta(days=367)).isoformat()},  # to now
        {"since": long_ago.isoformat(), "until": (long_ago + timedelta(days=367)).isoformat()},
    ):
        reply = await api.call("GET", "/admin/v1/usage", **query)
        assert reply.status == 400, query
        assert_error(reply.body, "invalid_value", "since")
        assert "366 days" in reply.body["error"]["message"]
    old = await api.ok("GET", "/admin/v1/usage", until=long_ago.isoformat())  # 30 days before
    assert old["data"] == []
    # An end not after the start is the caller's mistake, not an empty report.
    for until in (long_ago, long_ago - timedelta(seconds=1)):
        query = {"since": long_ago.isoformat(), "until": until.isoformat()}
        reply = await api.call("GET", "/admin/v1/usage", **query)
        assert reply.status == 400, query
        assert_error(reply.body, "invalid_value", "until")


async def test_a_sessions_requests_in_time_order_with_their_stages(api: Api) -> None:
    await write(
        api,
        [
            outcome(5, session="s1", pod="10.0.0.2:8000", queue_ms=3, ttft_ms=40, duration_ms=240),
            outcome(1, session="s1", pod="10.0.0.1:8000", ttft_ms=20.0, duration_ms=100.0),
            outcome(3, session="s1", outcome="refused", status=429),
            outcome(2, session="s2"),
        ],
    )
    session = await api.ok("GET", "/admin/v1/sessions/s1")
    assert [r["request_id"] for r in session["data"]] == ["req-0001", "req-0003", "req-0005"]
    last = session["data"][-1]
    assert (last["pod"], last["queue_ms"], last["ttft_ms"]) == ("10.0.0.2:8000", 3.0, 40.0)
    assert (last["duration_ms"], last["decode_ms"]) == (240.0, 200.0)
    assert (last["prompt_tokens"], last["completion_tokens"], last["cost_micros"]) == (10, 5, 1000)
    assert session["data"][1]["outcome"] == "refused" and session["data"][1]["status"] == 429
    assert session["data"][1]["decode_ms"] is None  # no first byte: no decode time
    page = await api.ok("GET", "/admin/v1/sessions/s1", limit=2)
    assert page["has_more"] and page["last_id"] == "req-0003"
    rest = await api.ok("GET", "/admin/v1/sessions/s1", after="req-0003")
    assert [r["request_id"] for r in rest["data"]] == ["req-0005"]


async def test_breaker_and_alert_history_by_tenant(api: Api) -> None:
    await write(
        api,
        [],
        [
            ("breaker.trip", "acme"),
            ("alert.platinum_breaker_open", "acme"),
            ("breaker.recover", "acme"),
            ("breaker.trip", "beta"),
            ("alert.backlog", ""),
        ],
    )
    breakers = await api.ok("GET", "/admin/v1/breakers")
    assert [(e["kind"], e["tenant"]) for e in breakers["data"]] == [
        ("breaker.trip", "acme"),
        ("breaker.recover", "acme"),
        ("breaker.trip", "beta"),
    ]
    assert breakers["data"][0]["detail"] == {"n": 0}
    acme = await api.ok("GET", "/admin/v1/breakers", tenant="acme", limit=1)
    assert acme["has_more"] and acme["data"][0]["kind"] == "breaker.trip"
    rest = await api.ok("GET", "/admin/v1/breakers", tenant="acme", after=acme["last_id"])
    assert [e["kind"] for e in rest["data"]] == ["breaker.recover"] and not rest["has_more"]
    alerts = await api.ok("GET", "/admin/v1/alerts")
    assert [e["kind"] for e in alerts["data"]] == ["alert.platinum_breaker_open", "alert.backlog"]
    only = await api.ok("GET", "/admin/v1/alerts", tenant="acme")
    assert [e["kind"] for e in only["data"]] == ["alert.platinum_breaker_open"]


async def test_usage_in_two_currencies_gives_no_sum_of_money(api: Api) -> None:
    """Amounts in two currencies do not add up (a price table changed its currency): the
    tokens add up, the money is none, as `llmgw usage` shows it (one definition of a total:
    ledger/usage.py)."""
    await write(api, [outcome(0), outcome(1, currency="EUR"), outcome(2, tenant="beta")])
    acme, beta = (await api.ok("GET", "/admin/v1/usage"))["data"]
    assert acme["charged_tokens"] == 30 and acme["cost_micros"] is None and acme["cost"] is None
    assert set(acme["currency"].split(",")) == {"EUR", "USD"}
    assert (beta["cost_micros"], beta["cost"], beta["currency"]) == (1000, 0.001, "USD")


class SlowPool:
    """A pool whose queries wait to be let go (or time out as asyncpg's command_timeout does)."""

    def __init__(self) -> None:
        self.running = 0
        self.most = 0
        self.go = asyncio.Event()
        self.timeout = False

    async def fetch(self, query: str, *args: Any) -> list[Any]:
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            if self.timeout:
                raise TimeoutError
            await self.go.wait()
            return []
        finally:
            self.running -= 1


async def test_reports_run_a_few_at_a_time_and_a_slow_one_says_so() -> None:
    """However many reports are asked at once, at most `concurrent` hold a connection (the rest
    of the pool stays free for /health and the changes to tenants and keys); one the database
    gives up on is a 503 `report_timeout` that says how to ask for less, not 'unavailable'."""
    pool = SlowPool()
    reports = Reports(pool, concurrent=2)
    window = Window(None, NOW - timedelta(days=30))
    asked = [asyncio.create_task(reports.usage(window, "model", PageRequest())) for _ in range(10)]
    await eventually_awaited(lambda: asyncio.sleep(0, pool.running == 2), 5, "two running")
    for _ in range(20):
        await asyncio.sleep(0)
    assert pool.most == 2
    pool.go.set()
    await asyncio.gather(*asked)
    pool.timeout = True
    with pytest.raises(ApiError) as refused:
        await reports.usage(window, "model", PageRequest())
    assert (refused.value.status, refused.value.code) == (503, "report_timeout")
    assert "narrow the window" in refused.value.message
