"""The admin API's Prometheus collectors. Labels are bounded: a route is its template in the
route table (or `unmatched`), a status its class."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

REQUESTS = Counter(
    "llmgw_admin_requests_total",
    "Admin API requests by route template and status class (2xx, 4xx, 5xx)",
    ["route", "status"],
)
SECONDS = Histogram(
    "llmgw_admin_request_seconds",
    "Admin API request time by route template",
    ["route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0),
)
CHANGES = Counter(
    "llmgw_admin_changes_total",
    "Changes committed (tenant.create, key.rotate …), each with its revision and audit row",
    ["action"],
)
