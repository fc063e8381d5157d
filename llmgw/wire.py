"""Every name that crosses a process boundary: headers, metadata namespaces, Redis keys.

The services never call each other; they agree only on what Envoy carries (ARCHITECTURE.md).
Add a name here before using it anywhere else.
"""

from __future__ import annotations

# API keys: `Authorization: Bearer sk-llmgw-…` or `api-key: sk-llmgw-…`. Envoy refuses a request
# without one before buffering its body (envoy/authn.lua); extauthz decides the rest.
KEY_PREFIX = "sk-llmgw-"

# Trusted tenant context: set by extauthz, stripped from client requests by Envoy.
HEADER_PREFIX = "x-llmgw-"
HEADER_TENANT = "x-llmgw-tenant"
HEADER_TIER = "x-llmgw-tier"
HEADER_PRIORITY = "x-llmgw-priority"
HEADER_MODEL = "x-llmgw-model"
HEADER_TOKEN_ESTIMATE = "x-llmgw-token-estimate"
# When Envoy had a request's whole body (ms since the epoch): extauthz sheds a check that then
# waited too long (llmgw/authzhttp.py BODY_AT).
HEADER_BODY_AT = "x-llmgw-body-at"
HEADER_SESSION = "x-session-id"
HEADER_REQUEST_ID = "x-request-id"
# vLLM sends a request with this header to that data-parallel rank: a pick the router makes.
HEADER_DATA_PARALLEL_RANK = "x-data-parallel-rank"
# vLLM's own (0.33 reads it and lets it override the body's `priority`): extauthz sets it from
# the tenant's priority (llmgw/priority.py), so what the pod schedules by is what we decided.
HEADER_VLLM_PRIORITY = "x-vllm-priority"
# Envoy's retries of one request, over the route's (a stored response must not move pods).
HEADER_MAX_RETRIES = "x-envoy-max-retries"
# To the client, on every request flow control admitted (extauthz/flow.py): the milliseconds it
# waited in the gateway's queue for a seat on the fleet (0: it did not wait), so that a slow
# answer can be told apart as queue, prefill or decode.
HEADER_QUEUE_MS = "x-llmgw-queue-ms"

# Dynamic metadata written by extauthz, read by Envoy's rate-limit descriptors and the router: the
# trusted tenant context (llmgw/tenant.py; the model is a request fact).
EXTAUTHZ_NAMESPACE = "envoy.filters.http.ext_authz"
META_TENANT = "tenant"
META_TIER = "tier"
META_PRIORITY = "priority"
META_SESSION = "session"
META_REQUEST_ID = "request_id"
META_MODEL = "model"
META_KEY_ID = "key_id"
# The request facts (llmgw/facts.py), in the same namespace.
META_TOKEN_ESTIMATE = "token_estimate"  # the token reservation, as a string (see facts.py)
META_PROMPT_ESTIMATE = "prompt_estimate"
# The most tokens the prompt can be: what a stream cut short before any usage is charged.
META_PROMPT_BOUND = "prompt_bound"
# The token estimate's parts as strings for the rate-limit descriptors (token_estimate =
# token_prompt + cap × token_n): a hard budget with less left lowers the cap instead of refusing.
META_TOKEN_PROMPT = "token_prompt"
META_TOKEN_CHOICES = "token_n"
# The prompt's ceiling (facts.py prompt_ceiling) as a string, for the descriptors: with the
# model, what prices a request's worst case for money budgets.
META_TOKEN_CEILING = "token_ceiling"
META_STREAM = "stream"
META_INCLUDE_USAGE = "include_usage"
META_CHOICES = "n"
META_MAX_OUTPUT = "max_output"
META_FIRST_TURN = "first_turn"
META_PREFIX_BLOCKS = "prefix_blocks"
META_KV_BLOCKS = "kv_blocks"  # the pods' block hashes (llmgw/kvblocks.py), hex as prefix_blocks
META_KV_BLOCK_SIZE = "kv_block_size"
# JSON members Envoy appends to the request body's object (envoy/rewrite.lua): the gateway's own
# values for fields the pod reads (`"cache_salt": "…"`, the output cap `"max_tokens": N`), after
# the client's.
META_BODY_SUFFIX = "body_suffix"
# A tenant's allowed models, space-separated (model names have no spaces), on GET /v1/models:
# Envoy drops the others from the pods' list (envoy/rewrite.lua). Absent: every model.
META_ALLOWED_MODELS = "allowed_models"
# Per-tenant limit overrides, shaped for Envoy's rate-limit `limit: {dynamic_metadata: ...}`:
# a struct {"requests_per_unit": int, "unit": "MINUTE"}; absent when the tier defaults apply.
META_LIMIT_REQUESTS = "limit_requests"
META_LIMIT_TOKENS = "limit_tokens"
# A tenant's own money budgets (its spec's `spend`: llmgw/tiers.py Spend, as a JSON string), for
# the ledger's soft limits; absent when its tier's apply.
META_SPEND = "spend"
# Envoy's ext_authz marks a request body cut at `with_request_body.max_request_bytes`.
HEADER_PARTIAL_BODY = "x-envoy-auth-partial-body"

# The OpenAI endpoints the pods serve: generation takes a JSON body (POST), models is read (GET).
CHAT_PATH = "/v1/chat/completions"
EMBEDDINGS_PATH = "/v1/embeddings"  # vectors: no output tokens, so no output cap
# The Responses API, stateless: its input read as the chat request vLLM renders it into.
RESPONSES_PATH = "/v1/responses"
GENERATION_PATHS = (CHAT_PATH, "/v1/completions", EMBEDDINGS_PATH, RESPONSES_PATH)
MODELS_PATH = "/v1/models"
# A stored response, where the operator keeps them: GET its ID, POST its ID + "/cancel".
RESPONSE_PREFIX = RESPONSES_PATH + "/"
CANCEL_SUFFIX = "/cancel"


def response_id(path: str) -> str | None:
    """The stored response a path names (its query removed); None: the path names none."""
    if not path.startswith(RESPONSE_PREFIX):
        return None
    named = path[len(RESPONSE_PREFIX) :].removesuffix(CANCEL_SUFFIX)
    return named if named and "/" not in named else None


def endpoint(path: str) -> str:
    """A path as the ledger records it: a route's parameter (a model's or a stored response's
    ID) as its name, so that what `llmgw usage` groups by is a set of routes, not of IDs."""
    if path.startswith(MODELS_PATH + "/"):
        return MODELS_PATH + "/{id}"
    if response_id(path) is None:
        return path[:256]
    suffix = CANCEL_SUFFIX if path.endswith(CANCEL_SUFFIX) else ""
    return RESPONSE_PREFIX + "{id}" + suffix


# Endpoint picking (Gateway API Inference Extension protocol): the router writes an ordered
# "ip:port,ip:port" list under this namespace and key; Envoy's override_host policy reads it.
LB_NAMESPACE = "envoy.lb"
DESTINATION_ENDPOINT = "x-gateway-destination-endpoint"
# The same protocol as other gateways speak it (router/picker.py): the pod that served, under
# LB_NAMESPACE, and the subset of pods a gateway allows for one request.
SERVED_ENDPOINT = "x-gateway-destination-endpoint-served"
SUBSET_HINT_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_HINT_KEY = "x-gateway-destination-endpoint-subset"

# Client-sent copies of these are removed before any filter reads them.
TRUSTED_HEADERS = (
    HEADER_TENANT,
    HEADER_TIER,
    HEADER_PRIORITY,
    HEADER_MODEL,
    HEADER_TOKEN_ESTIMATE,
    HEADER_BODY_AT,
    HEADER_VLLM_PRIORITY,
    HEADER_DATA_PARALLEL_RANK,
    DESTINATION_ENDPOINT,
    SERVED_ENDPOINT,
)

# Rate limiting.
RATELIMIT_DOMAIN = "llmgw"
# OpenAI's rate-limit headers on every answer the limiter gave, by kind: limit, remaining, reset.
RATE_HEADERS = {
    kind: (
        f"x-ratelimit-limit-{kind}",
        f"x-ratelimit-remaining-{kind}",
        f"x-ratelimit-reset-{kind}",
    )
    for kind in ("requests", "tokens")
}
# The rate limiter's answer is dynamic metadata (in every access-log entry): in ext_authz's
# namespace when the limiter runs inside extauthz, else in the RLS response's, which Envoy keeps
# under its rate-limit filter's name (tools/envoyconf.py Services.admission_namespace).
RATELIMIT_NAMESPACE = "envoy.filters.http.ratelimit"
# true on every answer the rate limiter gave: an admitted request without it reached a pod
# unchecked (the limiter failed open: it raised or ran over its budget inside extauthz, or
# `python -m ratelimit` was down or slower than Envoy's timeout).
META_DECIDED = "decided"
# What an admission drew from the fleet's borrowing pool (ratelimit/pool.py), as numbers; absent
# on base quota.
META_BORROWED_REQUESTS = "borrowed_requests"
META_BORROWED_TOKENS = "borrowed_tokens"
# true on an admission refused by the tenant's breaker, a 503: extauthz's own denial, which a
# local-reply mapper keeps as it is; behind the rate-limit filter (a 429 by Envoy's rule) the
# mapper turns it into the 503 (envoy/envoy.yaml.j2).
META_CIRCUIT_OPEN = "circuit_open"
# Over HTTP, on every denial of status 500 or more, which extauthz sends as a 429 (Envoy takes a
# 5xx from an HTTP authorization server for the server failing): the status meant, as a string
# ("503": the breaker's, or extauthz overloaded), for a local-reply mapper to restore.
META_STATUS = "status"
# The output cap per sequence the pod gets instead of extauthz's, when the tenant's hard budget
# has less left than the request's estimate (ratelimit/admit.lua). Envoy appends it to the
# request body after the limiter's answer (envoy/rewrite.lua): metadata, not a header, so a
# client has no name to forge it under.
META_OUTPUT_CAP = "output_cap"
# The same wait in extauthz's metadata (a number, ms), for the ledger's `queue_ms` column.
META_QUEUE_MS = "queue_ms"
# true on a request whose outcome flow control wants at once (extauthz/flow.py `Free.soon`):
# Envoy's router access log for these flushes every router_log_flush (20 ms), the other one, for
# the rest, every log_flush (0.2 s) (envoy/envoy.yaml.j2); the value is not read, only its
# presence (over HTTP it arrives as the string "true").
META_OUTCOME_SOON = "outcome_soon"
# The router's two access logs (their log_name), each a stream to the outcome feed.
ROUTER_LOG = "router"
ROUTER_LOG_SOON = "router_soon"
# A response's token usage, written by Envoy on the way out and read from the access log by the
# ledger: the pod's usage object (sse_to_metadata, json_to_metadata) when it arrived, and the
# count of content events that reached the client (envoy/usage.lua) for streams cut short.
USAGE_NAMESPACE = "llmgw.usage"
META_PROMPT_TOKENS = "prompt_tokens"
META_COMPLETION_TOKENS = "completion_tokens"
META_CACHED_TOKENS = "cached_tokens"
META_STREAMED_EVENTS = "streamed"
META_STREAM_FAILED = "stream_failed"  # the pod sent an error event after its 200


# Counters in Redis, one key prefix per tenant; the keys under it are llmgw/reservation.lua's,
# prepended to ratelimit/admit.lua and llmgw/settle.lua. The `{tenant}` hash tag keeps a
# tenant's keys in one Redis Cluster slot.
def tenant_prefix(tenant: str) -> str:
    """The key prefix of a tenant; braces in the ID are escaped so the hash tag stays intact."""
    return "llmgw:rl:{" + tenant.replace("{", "%7B").replace("}", "%7D") + "}"


def breaker_key(tenant: str) -> str:
    """The tenant's breaker (llmgw/breaker.lua): a hash in the slot of its counters."""
    return tenant_prefix(tenant) + ":cb"


# Flow control's service counts per tenant, merged by every extauthz replica (extauthz/served.lua).
FLOW_SERVED_KEY = "llmgw:flow:served"
# Fleet load published by the router for quota borrowing (Redis).
FLEET_LOAD_KEY = "llmgw:fleet:load"
# The pods' batches at each scrape (llmgw/podbatches.py): a stream every router replica adds to.
POD_BATCHES_KEY = "llmgw:fleet:batches"
# The fleet's borrowing pool (ratelimit/pool.py): its own hash tag, one Redis Cluster slot.
POOL_PREFIX = "llmgw:pool:{fleet}"

# The admin API's changes to tenants and keys (admin/migrations/0001_admin.sql), notified on this
# PostgreSQL channel with the tenant's new revision; extauthz's follower listens.
TENANTS_CHANNEL = "llmgw_tenants"

# The local stack's ready file (`llmgw up`), in its run directory beside its tenants file while it
# runs: `llmgw usage`/`spend` find its stores there, `llmgw keys` whether its admin API owns them.
READY_FILE = "ready.json"
