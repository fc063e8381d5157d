"""What the ledger recorded (ledger/migrations/: `outcomes`, `ledger_events`), read only: usage
and cost, a session's requests in order, breaker and alert history. Each list is paginated by
the key it is ordered by."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from admin.types import ApiError, Page, PageRequest
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


@dataclass(frozen=True)
class Window:
    """Which outcomes: a tenant's (None: all), from `since` (inclusive) to `until` (exclusive)."""

    tenant: str | None = None
    since: datetime | None = None
    until: datetime | None = None


class Reports:
    def __init__(self, pool: Any) -> None:  # asyncpg.Pool
        self.pool = pool

    async def usage(self, window: Window, by: GroupBy, page: PageRequest) -> Page[dict[str, Any]]:
        rows = await self.pool.fetch(
            f"SELECT * FROM (SELECT {GROUP_KEYS[by]} AS {by}, {usage.TOTALS} FROM outcomes"
            " WHERE ($1::text IS NULL OR tenant = $1) AND ($2::timestamptz IS NULL OR ts >= $2)"
            f" AND ($3::timestamptz IS NULL OR ts < $3) GROUP BY 1) g"
            f" WHERE $4::text IS NULL OR {by} > $4 ORDER BY {by} LIMIT $5",
            window.tenant,
            window.since,
            window.until,
            page.after,
            page.limit + 1,
        )
        items = [{"object": "usage", **r} for r in map(dict, rows)]
        return Page.of(items, page.limit, lambda r: r[by])

    async def session(self, session: str, page: PageRequest) -> Page[dict[str, Any]]:
        """The session's requests in time order (`after`: a request ID of it)."""
        rows = await self.pool.fetch(
            f"SELECT {SESSION_COLUMNS} FROM outcomes WHERE session = $1 AND ($2::text IS NULL"
            " OR (ts, request_id) > (SELECT ts, request_id FROM outcomes WHERE request_id = $2))"
            " ORDER BY ts, request_id LIMIT $3",
            session,
            page.after,
            page.limit + 1,
        )
        if not rows and page.after is None:
            raise ApiError.not_found("session", session)
        items = [{"object": "session.request", **r} for r in map(dict, rows)]
        return Page.of(items, page.limit, lambda r: r["request_id"])

    async def events(
        self, kind: EventKind, tenant: str | None, page: PageRequest
    ) -> Page[dict[str, Any]]:
        rows = await self.pool.fetch(
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

    async def sessions(self, tenant: str, limit: int) -> list[dict[str, Any]]:
        """The tenant's latest sessions, the most recently active first."""
        rows = await self.pool.fetch(
            "SELECT session, min(ts) AS started, max(ts) AS last, count(*) AS requests,"
            " sum(cost_micros)::bigint AS cost_micros,"
            " coalesce(string_agg(DISTINCT nullif(currency, ''), ','), '') AS currency"
            " FROM outcomes WHERE tenant = $1 AND session <> '' GROUP BY session"
            " ORDER BY last DESC, session LIMIT $2",
            tenant,
            limit,
        )
        return [dict(r) for r in rows]

    async def tiers(self, since: datetime) -> list[dict[str, Any]]:
        """Each tier's admissions since `since`: its tenants, requests, what they were refused,
        charged and drew from the fleet's borrowing pool (the ledger's `borrowed_*`)."""
        rows = await self.pool.fetch(
            "SELECT tier, count(DISTINCT tenant) AS tenants, count(*) AS requests,"
            " count(*) FILTER (WHERE outcome = 'refused') AS refused,"
            " sum(charged_tokens)::bigint AS charged_tokens,"
            " count(*) FILTER (WHERE borrowed_requests > 0 OR borrowed_tokens > 0) AS borrowing,"
            " sum(borrowed_tokens)::bigint AS borrowed_tokens"
            " FROM outcomes WHERE ts >= $1 GROUP BY tier ORDER BY tier",
            since,
        )
        return [dict(r) for r in rows]
