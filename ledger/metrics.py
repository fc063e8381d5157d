"""Prometheus collectors of the ledger's outcome stream (the database writer has its own, db.py).

Bounded: a tenant past the process's first `metrics.tenant_labels` is `other` (llmgw/telemetry.py
TENANTS); a model is its own label only once a pod has served it (a 2xx), and only the first
`metrics.model_labels` such, else `other`: the client writes the model, and a request refused
before any pod names whatever it likes."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from llmgw.outcome import Outcome
from llmgw.telemetry import TENANTS, Bounded, Children

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

REQUESTS = Counter(
    "llmgw_ledger_requests_total",
    "Requests by tenant, model and outcome kind (ok, aborted, upstream_error, refused).",
    ["tenant", "model", "outcome"],
)
TOKENS = Counter(
    "llmgw_ledger_tokens_total",
    "Tokens by tenant, model and kind (prompt, completion, cached, charged).",
    ["tenant", "model", "kind"],
)
COST = Counter(
    "llmgw_ledger_cost_micros_total",
    "What requests cost at the price table's prices, in micro-units of its currency, by tenant "
    "and model.",
    ["tenant", "model", "currency"],
)
TTFT = Histogram(
    "llmgw_ledger_ttft_seconds",
    "Time to the first byte sent to the client, by tenant and model.",
    ["tenant", "model"],
    buckets=_LATENCY,
)
DURATION = Histogram(
    "llmgw_ledger_duration_seconds",
    "Request duration, by tenant and model.",
    ["tenant", "model"],
    buckets=_LATENCY,
)
ENTRIES = Counter("llmgw_ledger_log_entries_total", "Access-log entries received.")
LOG_BATCH = Histogram(
    "llmgw_ledger_log_batch_entries",
    "Entries per access-log message from Envoy.",
    buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000),
)
SETTLEMENTS = Counter(
    "llmgw_ledger_settlements_total",
    "Settlements by result: settled (a reservation), unreserved (none found), duplicate.",
    ["result"],
)
UNCHECKED = Counter(
    "llmgw_ledger_unchecked_admissions_total",
    "Generation requests that reached a pod without a rate-limit decision: the rate-limit "
    "service failed open (down, or slower than Envoy's timeout), so no quota applied to them.",
    ["tenant"],
)
SETTLE_SECONDS = Histogram(
    "llmgw_ledger_settle_seconds",
    "One batch's settlement round trip to Redis.",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 2.0),
)
SETTLE_FAILURES = Counter(
    "llmgw_ledger_settle_failures_total", "Settlement batches that failed (Redis slow or down)."
)
PENDING = Gauge("llmgw_ledger_unsettled", "Outcomes waiting for settlement (Redis slow or down).")
UNSETTLED_DROPPED = Counter(
    "llmgw_ledger_unsettled_dropped_total",
    "Outcomes stored without settlement because the unsettled backlog was full (their "
    "reservations stay charged).",
)
RECONCILED = Counter(
    "llmgw_ledger_reconciled_total",
    "Outcomes the gRPC access log did not deliver, recovered from Envoy's file access log.",
)
MISSING = Counter(
    "llmgw_ledger_missing_outcomes_total",
    "Access-log records that could not be recovered, by reason (malformed: a line not of ours).",
    ["reason"],
)
UNCONFIRMED = Gauge(
    "llmgw_ledger_unconfirmed_outcomes",
    "Records of Envoy's file access log not yet confirmed in the ledger's database.",
)
UNCONFIRMED_AGE = Gauge(
    "llmgw_ledger_unconfirmed_age_seconds",
    "How long the oldest unconfirmed record of the file access log has waited (0: none).",
)
ALERTS = Counter(
    "llmgw_ledger_alerts_total", "Alerts emitted, by kind (ledger/alerts.py).", ["kind"]
)
DELIVERIES = Counter(
    "llmgw_ledger_alert_deliveries_total",
    "Webhook attempts and deliveries by alert kind and result: delivered, retried (an attempt "
    "failed, another follows), rejected (a 4xx: not retried), failed (out of attempts), dropped "
    "(the hook's queue was full: the oldest goes; or left at shutdown).",
    ["kind", "result"],
)
ALERT_QUEUE = Gauge(
    "llmgw_ledger_alert_queue", "Deliveries waiting, summed over the webhooks (in flight too)."
)
# The tenant breaker (ledger/breaker.py); what it refuses: ratelimit's
# llmgw_ratelimit_decisions_total{result="circuit_open"}.
BREAKER_TRIPS = Counter(
    "llmgw_breaker_trips_total",
    "Tenant breaker trips by cause (the status, or stream: an error after the 200) and reopen "
    "(true: a failure during recovery).",
    ["tenant", "tier", "cause", "reopen"],
)
BREAKER_EXCUSED = Counter(
    "llmgw_breaker_excused_total",
    "Failures that did not weigh on their tenant's breaker, by cause: fleet (Envoy's flags: a "
    "reset, no connection, overflow, no healthy pod) or pod (it failed many tenants at once).",
    ["cause"],
)
BREAKER_OPEN_SECONDS = Histogram(
    "llmgw_breaker_open_seconds",
    "How long each trip keeps a tenant's breaker open (its cool-down), by tier.",
    ["tier"],
    buckets=(1, 5, 15, 30, 60, 120, 240, 480, 960, 1920),
)
BREAKER_RECOVERY_SECONDS = Histogram(
    "llmgw_breaker_recovery_seconds",
    "From a breaker's first trip to its full recovery (all steps passed), by tier.",
    ["tier"],
    buckets=(5, 15, 30, 60, 120, 300, 600, 1200, 2400, 4800),
)

MODELS = Bounded(64)  # the models served; the composition root sets metrics.model_labels


def served(o: Outcome) -> None:
    """Learns the outcome's model if a pod answered it with a 2xx: a pod serves only models it
    has, so the set is the fleet's, whatever the clients write."""
    if o.pod and 200 <= o.status < 300:
        MODELS.admit(o.model)


# Looked up once per label set (every outcome updates them).
requests = Children(REQUESTS, tenant=TENANTS.admit, model=MODELS.label)
tokens = Children(TOKENS, tenant=TENANTS.admit, model=MODELS.label)
cost = Children(COST, tenant=TENANTS.admit, model=MODELS.label)
settlements = Children(SETTLEMENTS)
unchecked = Children(UNCHECKED, tenant=TENANTS.admit)
ttft = Children(TTFT, tenant=TENANTS.admit, model=MODELS.label)
duration = Children(DURATION, tenant=TENANTS.admit, model=MODELS.label)
breaker_trips = Children(BREAKER_TRIPS, tenant=TENANTS.admit)
