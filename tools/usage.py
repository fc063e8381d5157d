"""`llmgw usage`: the operator's view of the ledger (ledger/db.py's `outcomes` table).

    llmgw usage [--database-url URL] [--tenant T] [--session S] [--since 1h]
                [--by tenant|session|model|pod] [--json] [--events]

Totals by a key (default tenant) as an aligned table, the charged tokens and their cost (at the
price table's prices when each request was recorded: llmgw/prices.py) split into base and
borrowed quota (the seed's bill); `--session S`: that session's requests in time order; `--json`:
the matching requests, one JSON object per line, keys JSON_FIELDS first (with `--by`, the totals
instead); `--events`: what happened to tenants rather than to requests (`ledger_events`: tenant
breaker trips and recoveries, alerts), in time order. The database: `--database-url`, else
$LLMGW_DATABASE_URL, else the `database_url` of the newest `.llmgw/run-*/ready.json`, else the
local stack's PostgreSQL if it runs (`.llmgw/postgres/`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal

from ledger import usage
from llmgw import wire
from llmgw.outcome import JSON_FIELDS
from tools import postgres

By = Literal["tenant", "session", "model", "pod"]
BY_KEYS: tuple[By, ...] = ("tenant", "session", "model", "pod")
STATE_DIR = Path(".llmgw")

TOTAL_COLUMNS = (
    "requests",
    "errors",
    "refused",
    "aborted",
    "prompt_tokens",
    "completion_tokens",
    "charged_tokens",
    "base_tokens",
    "borrowed_tokens",
    "borrowed_requests",
    "cost",
    "base_cost",
    "borrowed_cost",
    "currency",
    "gpu_seconds",
    "queue_p50_ms",
    "queue_p90_ms",
    "ttft_p50_ms",
    "ttft_p90_ms",
)
SESSION_COLUMNS = (
    "ts",
    "request_id",
    "model",
    "pod",
    "status",
    "outcome",
    "flags",
    "attempts",
    "prompt_tokens",
    "completion_tokens",
    "charged_tokens",
    "cost",
    "gpu_seconds",
    "queue_ms",
    "ttft_ms",
    "duration_ms",
)
# Every column of `outcomes`, JSON_FIELDS first (the --json order).
RECORD_COLUMNS = (
    *JSON_FIELDS,
    *(
        c
        for c in (
            "tier",
            "key_id",
            "endpoint",
            "flags",
            "attempts",
            "stream",
            "cached_tokens",
            "reserved_tokens",
            "borrowed_requests",
            "borrowed_tokens",
            "bytes_in",
            "bytes_out",
            "cost_micros",
        )
        if c not in JSON_FIELDS
    ),
)


class Filters:
    """WHERE clause and parameters from the command's filters."""

    def __init__(
        self, tenant: str | None = None, session: str | None = None, since: datetime | None = None
    ) -> None:
        self.clauses: list[str] = []
        self.params: list[Any] = []
        for column, value in (("tenant", tenant), ("session", session), ("ts", since)):
            if value is not None:
                self.params.append(value)
                op = ">=" if column == "ts" else "="
                self.clauses.append(f"{column} {op} ${len(self.params)}")

    @property
    def where(self) -> str:
        return f"WHERE {' AND '.join(self.clauses)}" if self.clauses else ""


# Columns computed from the stored ones.
COMPUTED = {
    "cost": f"{usage.amount('cost_micros')} AS cost",
    "gpu_seconds": "round(gpu_seconds::numeric, 3) AS gpu_seconds",  # milliseconds: estimated
}


def totals_sql(by: By, filters: Filters) -> str:
    key = {"tenant": "tenant", "session": "session", "model": "model", "pod": "pod"}[by]
    return (
        f"SELECT {key} AS key, {usage.TOTALS}"
        f" FROM outcomes {filters.where} GROUP BY {key} ORDER BY requests DESC, {key}"
    )


EVENT_COLUMNS = ("ts", "kind", "tenant", "detail")


def events_sql(filters: Filters) -> str:
    return f"SELECT {', '.join(EVENT_COLUMNS)} FROM ledger_events {filters.where} ORDER BY ts, id"


def records_sql(filters: Filters, columns: Sequence[str] = RECORD_COLUMNS) -> str:
    selected = ", ".join(COMPUTED.get(c, c) for c in columns)
    return f"SELECT {selected} FROM outcomes {filters.where} ORDER BY ts, request_id"


async def query(url: str, sql: str, params: Sequence[Any]) -> list[dict[str, Any]]:
    import asyncpg

    conn = await asyncpg.connect(url, timeout=10, command_timeout=60)
    try:
        return [dict(r) for r in await conn.fetch(sql, *params)]
    finally:
        await conn.close()


# Formatting.


def cell(value: Any) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}"
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return str(value)


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """An aligned text table: text columns left-aligned, numbers right-aligned."""
    cells = [[cell(r[c]) for c in columns] for r in rows]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]
    numeric = [
        bool(rows) and all(isinstance(r[c], int | float | Decimal) or r[c] is None for r in rows)
        for c in columns
    ]

    def line(values: Sequence[str]) -> str:
        parts = [
            v.rjust(w) if n else v.ljust(w) for v, w, n in zip(values, widths, numeric, strict=True)
        ]
        return "  ".join(parts).rstrip()

    return "\n".join([line([c.upper() for c in columns]), *(line(row) for row in cells)])


def json_line(row: dict[str, Any]) -> str:
    return json.dumps({k: _json_value(v) for k, v in row.items()})


def _json_value(value: Any) -> Any:
    if isinstance(value, datetime):
        return cell(value)
    if isinstance(value, Decimal):  # an amount: a JSON number (cost_micros is the exact one)
        return float(value)
    return value


# Arguments.


def since(text: str) -> datetime:
    """`90s`, `30m`, `1h`, `7d`, `2w` ago, or an ISO 8601 time (UTC when no zone is given)."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    text = text.strip()
    if text[:-1].isdigit() and text[-1:] in units:
        return datetime.now(UTC) - timedelta(seconds=int(text[:-1]) * units[text[-1]])
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration like 1h or a time: {text!r}") from None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def from_ready(key: str, state_dir: Path = STATE_DIR) -> str | None:
    """A URL (`database_url`, `redis_url`) of the newest run's ready.json that has it."""
    runs = sorted(
        state_dir.glob(f"run-*/{wire.READY_FILE}"), key=lambda p: p.parent.name, reverse=True
    )
    for ready in runs:
        try:
            url = json.loads(ready.read_text()).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(url, str) and url:
            return url
    return None


def default_database_url(state_dir: Path = STATE_DIR) -> str | None:
    """$LLMGW_DATABASE_URL, the newest run's ready.json, or the local stack's running server."""
    if url := os.environ.get("LLMGW_DATABASE_URL"):
        return url
    return from_ready("database_url", state_dir) or postgres.running_url(state_dir / "postgres")


def register(sub: Any) -> None:
    """Add `usage` to the `llmgw` subcommands."""
    p = sub.add_parser("usage", help="usage from the ledger: totals, a session, JSON records")
    p.add_argument("--database-url", help="postgresql://… (default: $LLMGW_DATABASE_URL, local)")
    p.add_argument("--tenant", help="only this tenant")
    p.add_argument("--session", help="only this session: its requests in time order")
    p.add_argument("--since", type=since, help="only requests since: 1h, 30m, 7d or an ISO time")
    p.add_argument("--by", choices=BY_KEYS, help="totals by this key (default tenant)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--events", action="store_true", help="breaker trips, recoveries and alerts")
    p.set_defaults(func=cmd_usage)


def cmd_usage(args: argparse.Namespace) -> int:
    url = args.database_url or default_database_url()
    if not url:
        raise ValueError("no database: give --database-url or set LLMGW_DATABASE_URL")
    import asyncpg

    try:
        out = asyncio.run(render(url, args))
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise ValueError(f"usage: database: {exc}") from exc  # never the URL: it has a password
    sys.stdout.write(out)
    return 0


async def render(url: str, args: argparse.Namespace) -> str:
    """The command's output for parsed arguments `args`."""
    if args.events:
        return await render_events(url, Filters(args.tenant, None, args.since), args.json)
    filters = Filters(args.tenant, args.session, args.since)
    if args.json and args.by is None:
        rows = await query(url, records_sql(filters), filters.params)
        return "".join(json_line(r) + "\n" for r in rows)
    if args.session is not None and args.by is None:
        rows = await query(url, records_sql(filters, SESSION_COLUMNS), filters.params)
        return table(rows, SESSION_COLUMNS) + "\n"
    by: By = args.by or "tenant"
    rows = await query(url, totals_sql(by, filters), filters.params)
    if args.json:
        return "".join(json_line({by: r.pop("key"), **r}) + "\n" for r in rows)
    for r in rows:
        r[by] = r.pop("key") or "-"
    return table(rows, (by, *TOTAL_COLUMNS)) + "\n"


async def render_events(url: str, filters: Filters, as_json: bool) -> str:
    rows = await query(url, events_sql(filters), filters.params)
    for r in rows:  # jsonb arrives as its text
        r["detail"] = json.loads(r["detail"]) if as_json else r["detail"].replace(" ", "")
    if as_json:
        return "".join(json_line(r) + "\n" for r in rows)
    return table(rows, EVENT_COLUMNS) + "\n"
