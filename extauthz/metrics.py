"""Prometheus collectors of extauthz."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from llmgw import telemetry
from llmgw.telemetry import Children

DECISIONS = Counter(
    "llmgw_extauthz_decisions_total",
    "Check decisions by result (allow or the error code) and tenant ('' when unknown).",
    ["result", "tenant"],
)
DECISION_SECONDS = Histogram(
    "llmgw_extauthz_decision_seconds",
    "Time to decide one check, excluding its transport (gRPC or HTTP).",
    buckets=(0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05),
)
decisions = Children(DECISIONS, tenant=telemetry.TENANTS.admit)  # (result, tenant), once per pair
TENANTS = Gauge("llmgw_extauthz_tenants", "Tenants in the live snapshot.")
POOLED_BODIES = Counter(
    "llmgw_extauthz_pooled_bodies_total",
    "Request bodies large enough to be read in the body pool, off the event loop.",
)
POOL_RESTARTS = Counter(
    "llmgw_extauthz_body_pool_restarts_total",
    "Body pools replaced after their worker died (killed, out of memory).",
)
PICK_ERRORS = Counter(
    "llmgw_extauthz_pick_errors_total",
    "Picks by the router in this process that raised: the request went on without one.",
)
ADMIT_ERRORS = Counter(
    "llmgw_extauthz_admit_errors_total",
    "Admissions by the rate limiter in this process that raised (cause error) or ran over "
    "admit_timeout_ms (cause timeout): the request went on unchecked.",
    ["cause"],
)
admit_errors = Children(ADMIT_ERRORS)
HTTP_ERRORS = Counter(
    "llmgw_extauthz_http_errors_total",
    "Checks over HTTP that were refused as malformed or too large (the connection closed), or "
    "that raised (cause error: a 500, which Envoy fails closed).",
    ["cause"],
)
http_errors = Children(HTTP_ERRORS)

# Flow control (extauthz/flow.py). `model`: one the fleet serves (else "other"); `band`: the
# tenant's priority, 1-10; `tenant`: bounded as every tenant label (llmgw.telemetry.TENANTS).
QUEUE_LENGTH = Gauge(
    "llmgw_flow_queue_length", "Requests waiting in flow control's queue.", ["model", "band"]
)
queue_length = Children(QUEUE_LENGTH)
QUEUE_WAIT_SECONDS = Histogram(
    "llmgw_flow_queue_wait_seconds",
    "Time each request flow control dispatched waited in its queue (0: a free seat at once).",
    ["model", "band"],
    buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0),
)
queue_wait = Children(QUEUE_WAIT_SECONDS)
DISPATCHES = Counter(
    "llmgw_flow_dispatches_total",
    "Requests flow control sent to the fleet, by tenant and whether they waited (queued).",
    ["tenant", "queued"],
)
dispatches = Children(DISPATCHES, tenant=telemetry.TENANTS.admit)
REFUSALS = Counter(
    "llmgw_flow_refusals_total",
    "Requests flow control refused or lost while queued, by tenant and reason: queue_full, "
    "queue_timeout, cancelled (the client left).",
    ["tenant", "reason"],
)
refusals = Children(REFUSALS, tenant=telemetry.TENANTS.admit)
SERVICE_TOKENS = Gauge(
    "llmgw_flow_service_tokens",
    "Service each tenant received (prompt + output tokens dispatched, decayed), at its latest "
    "dispatch: the order of dispatch within a priority band, least served first.",
    ["tenant"],
)
service_tokens = Children(SERVICE_TOKENS, tenant=telemetry.TENANTS.admit)
SATURATED = Gauge(
    "llmgw_flow_saturated",
    "1 while no pod serving the model had a seat free, at the model's latest check.",
    ["model"],
)
saturated = Children(SATURATED)
# The tenants' database source (extauthz/follower.py): while down, the last snapshot serves.
TENANTS_SOURCE_UP = Gauge(
    "llmgw_extauthz_tenants_source_up",
    "1 while the tenants database answers the follower; 0: the last snapshot serves, stale.",
)
TENANTS_SYNCED = Gauge(
    "llmgw_extauthz_tenants_synced_timestamp_seconds",
    "Unix time of the tenants database's latest read (its age: how stale the snapshot may be).",
)
