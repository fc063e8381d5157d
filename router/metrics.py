"""Prometheus collectors of the router (module level, prefixed llmgw_router_)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from llmgw.telemetry import Children

_FAST = (0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05)

PICKS = Counter(
    "llmgw_router_picks_total",
    "Picks answered (the request sent to the pod) by first pod and reason",
    ["pod", "reason"],
)
NO_POD = Counter(
    "llmgw_router_no_pod_total", "Picks with no pod left (Envoy's fallback picks)", ["stage"]
)
PICK_SECONDS = Histogram("llmgw_router_pick_seconds", "Time to decide a pick", buckets=_FAST)
PLUGIN_SECONDS = Histogram(
    "llmgw_router_plugin_seconds",
    "Time spent in each plugin per pick, in one pick of 16 (router/engine.py TIMED_EVERY)",
    ["plugin"],
    buckets=_FAST,
)
SCRAPE_AGE = Gauge("llmgw_router_scrape_age_seconds", "Age of the last good scrape", ["pod"])
OUTCOMES = Counter(
    "llmgw_router_outcomes_total",
    "Outcomes from Envoy's router access logs, by feed: soon (flushed every 20 ms, the requests "
    "flow control wants at once) or batched (every 0.2 s)",
    ["feed"],
)
SCRAPE_ERRORS = Counter("llmgw_router_scrape_errors_total", "Failed scrapes", ["pod"])
IN_FLIGHT = Gauge("llmgw_router_in_flight", "Requests picked and not finished", ["pod"])
SPEED = Gauge("llmgw_router_pod_speed", "Decode speed relative to the fastest pod", ["pod"])
PICKABLE = Gauge("llmgw_router_pod_pickable", "1 if the pod may be picked", ["pod"])
MODEL_CONTEXT = Gauge(
    "llmgw_router_model_context_tokens",
    "Each served model's context: the least max_model_len of the pods serving it",
    ["model"],
)
KV_BATCHES = Counter(
    "llmgw_router_kv_event_batches_total",
    "KV-event batches from the pods, by result: applied, replayed (after a gap), malformed, "
    "lost (a gap no replay filled: the pod's entries dropped), disconnected (entries dropped)",
    ["result"],
)
KV_LOOKUPS = Counter(
    "llmgw_router_kv_lookups_total",
    "Picks with the pods' block hashes, by whether some pod's KV events show the prompt's first "
    "block (all misses while the pods publish: they hash otherwise than extauthz's kv_hashing)",
    ["result"],
)
KV_BLOCKS = Gauge("llmgw_router_kv_blocks", "Distinct KV blocks the pods' events say they hold")
FLEET_LOAD = Gauge("llmgw_router_fleet_load", "Fleet load published for quota borrowing")

# Looked up once per label set (the hot path's updates).
picks = Children(PICKS)
in_flight = Children(IN_FLIGHT)
