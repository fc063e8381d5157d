"""What the ledger recorded (ledger/migrations/: `outcomes`, `ledger_events`), read only: usage
and cost, a session's requests in order, breaker and alert history. Each list is paginated by
the key it is ordered by.

Every query is bounded whatever the caller sends: usage reads a window of at most MAX_DAYS
(the last DEFAULT_DAYS by default), a tenant's recent sessions the latest RECENT_ROWS of its
requests in such a window, and each page at most a page's rows, through an index of `outcomes`
((tenant, ts), (session, ts): ledger/migrations/0001_outcomes.sql)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from admin.types import DEFAULT_DAYS, MAX_DAYS, ApiError, Page, PageRequest
from ledger import usage

GroupBy = Literal["tenant", "model", "day"]
GROUP_KEYS: dict[GroupBy, str] = {
    "tenant": "tenant",
    "model": "model",
    "day": "to_char(ts AT TIME ZONE 'UTC', 'YYYY-MM-DD')",  # UTC days
}
SESSION_COLUMNS = (
    "request_id, ts, tenant, model, endpoint, pod, status, outcome, flags, attempts, stream,"
    " queue_ms, ttft_ms, duration_ms, duration_ms - ttft_ms AS decode_ms,"  # decode: after TTFT
    " prompt_tokens, completion_tokens, cached_tokens, charged_tokens, cost_micros, currency,"
    " gpu_seconds"
)
# The ledger's event kinds (ledger/breaker.py: breaker.trip, breaker.recover; ledger/alerts.py:
# alert.<kind>), by what their names start with.
EventKind = Literal["breaker.", "alert."]


def days_back(now: datetime, days: int) -> datetime:
    """The start of the last `days` UTC days, the current one included."""
    today = now.astimezone(UTC).date()
    return datetime.combine(today - timedelta(days=days - 1), datetime.min.time(), UTC)


@dataclass(frozen=True)
class Window:
    """Which outcomes: a tenant's (None: all), from `since` (inclusive) to `until` (exclusive;
    None: no end, the window then runs to now)."""

    tenant: str | None
    since: datetime
    until: datetime | None = None

    @classmethod
    def bounded(
        cls, tenant: str | None, since: datetime | None, until: datetime | None, now: datetime
    ) -> Window:
        """The caller's window: with no `since`, the DEFAULT_DAYS UTC days up to `until` (or
        now); a window longer than MAX_DAYS is a 400."""
        end = now if until is None else until
        # `until` is exclusive: the last day is the one its instant before falls in (an `until`
        # at midnight ends the day before, and the window still holds DEFAULT_DAYS days).
        try:
            last = end if until is None else end - timedelta(microseconds=1)
            start = days_back(last, DEFAULT_DAYS) if since is None else since
        except OverflowError as exc:  # before 0001-01-31 UTC
            raise ApiError.invalid("until", f"a time {DEFAULT_DAYS} days after year 1") from exc
        if end <= start:
            raise ApiError.invalid("until", "after `since`")
        if end - start > timedelta(days=MAX_DAYS):
            raise ApiError.invalid(
                "since", f"at most {MAX_DAYS} days before `until` (or now, without `until`)"
            )
        return cls(tenant, start, until)


def _arg(args: list[Any], value: Any) -> str:
    """SQL: `value` as the statement's next parameter."""
    args.append(value)
    return f"${len(args)}"


def _within(window: Window, args: list[Any], table: str = "") -> str:
    """SQL: the window's rows. A condition only where it applies: the plan the database keeps
    for a statement after a few runs is made without the parameters' values, and for `($1 IS
    NULL OR tenant = $1)` it scans every tenant's rows (measured: 214 ms for one of 10 rows)."""
    where = [f"{table}ts >= {_arg(args, window.since)}"]
    if window.tenant is not None:
        where.append(f"{table}tenant = {_arg(args, window.tenant)}")
    if window.until is not None:
        where.append(f"{table}ts < {_arg(args, window.until)}")
    return " AND ".join(where)


@dataclass(frozen=True)
class Recent:
    """A tenant's recent sessions; `partial`: the scan reached its bound (older requests of
    them, and older sessions, may not have been read)."""

    sessions: list[dict[str, Any]]
    partial: bool


class Reports:
    def __init__(self, pool: Any, concurrent: int = 1) -> None:  # asyncpg.Pool
        self.pool = pool
        # A report may read many rows for seconds: at most `concurrent` run at once, so the pool
        # keeps connections for /health and the changes to tenants and keys, whatever is asked.
        self._slots = asyncio.Semaphore(concurrent)

    async def _fetch(self, query: str, *args: Any) -> list[Any]:
        async with self._slots:
            try:
                return list(await self.pool.fetch(query, *args))
            except TimeoutError as exc:  # the pool's command_timeout: the query is cancelled
                raise ApiError(
                    503,
                    "the report did not finish in time: name a tenant or narrow the window"
                    " (since, until)",
                    "report_timeout",
                    type="server_error",
                ) from exc

    async def usage(self, window: Window, by: GroupBy, page: PageRequest) -> Page[dict[str, Any]]:
        """The window's totals by `by`, a page of them. The rows read: a tenant's in the window
        through its (tenant, ts) index, or every tenant's in the window (by model or day); by
        tenant, those of the page's tenants only."""
        if by == "tenant" and window.tenant is None:
            return await self._usage_by_tenant(window, page)
        args: list[Any] = []
        where = _within(window, args)
        after = "" if page.after is None else f" WHERE {by} > {_arg(args, page.after)}"
        rows = await self._fetch(
            f"SELECT * FROM (SELECT {GROUP_KEYS[by]} AS {by}, {usage.TOTALS} FROM outcomes"
            f" WHERE {where} GROUP BY 1) g{after} ORDER BY {by} LIMIT {_arg(args, page.limit + 1)}",
            *args,
        )
        items = [{"object": "usage", **r} for r in map(dict, rows)]
        return Page.of(items, page.limit, lambda r: r[by])

    async def _usage_by_tenant(self, window: Window, page: PageRequest) -> Page[dict[str, Any]]:
        """Every tenant's totals, a page: first the page's tenants, walking the (tenant, ts)
        index from one tenant to the next (a probe each, and one for a row in the window: the
        walk passes tenants with none), then only their rows are read."""
        args: list[Any] = []
        start = "" if page.after is None else f" WHERE tenant > {_arg(args, page.after)}"
        within = _within(Window(None, window.since, window.until), args, "o.")
        tenants = await self._fetch(
            "WITH RECURSIVE walk(tenant) AS ("
            f" (SELECT tenant FROM outcomes{start} ORDER BY tenant LIMIT 1)"
            " UNION ALL SELECT (SELECT o.tenant FROM outcomes o WHERE o.tenant > walk.tenant"
            " ORDER BY o.tenant LIMIT 1) FROM walk WHERE walk.tenant IS NOT NULL)"
            " SELECT tenant FROM walk WHERE tenant IS NOT NULL AND EXISTS (SELECT FROM outcomes o"
            f" WHERE o.tenant = walk.tenant AND {within}) LIMIT {_arg(args, page.limit + 1)}",
            *args,
        )
        names = [r["tenant"] for r in tenants]
        args = [names[: page.limit]]
        rows = await self._fetch(
            f"SELECT tenant, {usage.TOTALS} FROM outcomes WHERE tenant = ANY($1::text[])"
            f" AND {_within(Window(None, window.since, window.until), args)}"
            " GROUP BY tenant ORDER BY tenant",
            *args,
        )
        items = [{"object": "usage", **r} for r in map(dict, rows)]
        return Page(items, len(names) > page.limit, items[-1]["tenant"] if items else None)

    async def session(self, session: str, page: PageRequest) -> Page[dict[str, Any]]:
        """The session's requests in time order (`after`: a request ID of it)."""
        # `session <> ''`: the (session, ts) index's predicate, which a plan made without the
        # parameters' values cannot otherwise know holds (it would scan every row); a page
        # after a request seeks to that request's time in the index (a statement of its own:
        # `$2 IS NULL OR` would leave the seek a filter).
        args: list[Any] = [session]
        after = ""
        if page.after is not None:
            at = f"(SELECT ts FROM outcomes WHERE request_id = {_arg(args, page.after)})"
            key = at.replace("SELECT ts", "SELECT ts, request_id")
            after = f" AND ts >= {at} AND (ts, request_id) > {key}"
        rows = await self._fetch(
            f"SELECT {SESSION_COLUMNS} FROM outcomes WHERE session = $1 AND session <> ''{after}"
            f" ORDER BY ts, request_id LIMIT {_arg(args, page.limit + 1)}",
            *args,
        )
        if not rows and page.after is None:
            raise ApiError.not_found("session", session)
        items = [{"object": "session.request", **r} for r in map(dict, rows)]
        return Page.of(items, page.limit, lambda r: r["request_id"])

    async def events(
        self, kind: EventKind, tenant: str | None, page: PageRequest
    ) -> Page[dict[str, Any]]:
        rows = await self._fetch(
            "SELECT id, ts, kind, tenant, detail FROM ledger_events WHERE starts_with(kind, $1)"
            " AND ($2::text IS NULL OR tenant = $2) AND ($3::bigint IS NULL OR id > $3)"
            " ORDER BY id LIMIT $4",
            kind,
            tenant,
            None if page.after is None else int(page.after),
            page.limit + 1,
        )
        items = [{"object": "event", **r} for r in map(dict, rows)]
        return Page.of(items, page.limit, lambda r: r["id"])

    async def sessions(self, tenant: str, since: datetime, limit: int, scan: int) -> Recent:
        """The tenant's latest sessions since `since`, the most recently active first: those
        of its latest `scan` requests with a session (its (tenant, ts) index read backwards),
        with their requests, first and last among those."""
        rows = await self._fetch(
            "SELECT session, min(ts) AS started, max(ts) AS last, count(*) AS requests,"
            " sum(cost_micros)::bigint AS cost_micros,"
            " coalesce(string_agg(DISTINCT nullif(currency, ''), ','), '') AS currency,"
            " sum(count(*)) OVER () AS scanned"
            " FROM (SELECT session, ts, cost_micros, currency FROM outcomes"
            " WHERE tenant = $1 AND ts >= $2 AND session <> '' ORDER BY ts DESC LIMIT $3) latest"
            " GROUP BY session ORDER BY last DESC, session LIMIT $4",
            tenant,
            since,
            scan,
            limit,
        )
        sessions = [dict(r) for r in rows]
        scanned = int(sessions[0].pop("scanned")) if sessions else 0
        for other in sessions[1:]:
            other.pop("scanned")
        return Recent(sessions, scanned >= scan)

    async def tiers(self, since: datetime) -> list[dict[str, Any]]:
        """Each tier's admissions since `since`: its tenants, requests, what they were refused,
        charged and drew from the fleet's borrowing pool (the ledger's `borrowed_*`)."""
        rows = await self._fetch(
            "SELECT tier, count(DISTINCT tenant) AS tenants, count(*) AS requests,"
            " count(*) FILTER (WHERE outcome = 'refused') AS refused,"
            " sum(charged_tokens)::bigint AS charged_tokens,"
            " count(*) FILTER (WHERE borrowed_requests > 0 OR borrowed_tokens > 0) AS borrowing,"
            " sum(borrowed_tokens)::bigint AS borrowed_tokens"
            " FROM outcomes WHERE ts >= $1 GROUP BY tier ORDER BY tier",
            since,
        )
        return [dict(r) for r in rows]
