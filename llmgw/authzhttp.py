"""ext_authz over HTTP (Envoy's `http_service`): what crosses between Envoy and extauthz.

The check is an HTTP/1.1 request (the client's method, path, the headers below and the body) and
its answer a response: 200 allows, any other status denies with its body. Envoy takes each of the
answer's headers by name (envoy/envoy.yaml.j2 renders the matchers from this module):
- upstream names are set on the request to the pod, client names are added to the response
  (to the denial's, or to the pod's on success), and one header named in both goes to both;
- `x-envoy-auth-headers-to-remove` names request headers Envoy removes;
- metadata names become ext_authz's dynamic metadata under the same key, as strings: Envoy's
  `dynamic_metadata_from_headers` makes no numbers or booleans. `Typed` restores the contract's
  types for a reader of that metadata (the ledger); a struct (a tenant's limit overrides, for
  Envoy's rate-limit filter) is not sent, which is why this mode needs the rate limiter inside
  extauthz (tools/envoyconf.py).

Envoy takes any 5xx from an HTTP authorization server for the server failing: a 5xx denial (the
breaker's 503, extauthz overloaded) is sent as a 429 carrying the status meant in its `status`
metadata, which Envoy's local-reply mapper restores (the breaker's also by its `circuit_open`;
extauthz/httpserver.py)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from llmgw import wire

# Request headers Envoy forwards besides the ones it always does (method, path, host,
# authorization): what the decision reads, and every name it strips from the client's request.
REQUEST_EXACT = (
    "api-key",
    "content-encoding",
    wire.HEADER_SESSION,
    wire.HEADER_REQUEST_ID,
    wire.HEADER_PARTIAL_BODY,
    wire.DESTINATION_ENDPOINT,
    wire.HEADER_VLLM_PRIORITY,
    "traceparent",
    "tracestate",
)
REQUEST_PREFIXES = (wire.HEADER_PREFIX,)

# The answer's headers, by where Envoy puts them.
UPSTREAM_EXACT = (
    wire.HEADER_SESSION,
    wire.HEADER_REQUEST_ID,
    wire.HEADER_VLLM_PRIORITY,
    wire.HEADER_MAX_RETRIES,
)
UPSTREAM_PREFIXES = (wire.HEADER_PREFIX,)
# Added to the pod's response, which Envoy appends to (where gRPC's answer overwrites): the
# pod's own headers of these names are removed first (envoy/envoy.yaml.j2), or a client would
# read two session IDs joined by a comma.
CLIENT_ON_SUCCESS = (
    wire.HEADER_SESSION,
    wire.HEADER_QUEUE_MS,
    *(n for names in wire.RATE_HEADERS.values() for n in names),
)
CLIENT_EXACT = (
    *CLIENT_ON_SUCCESS,
    "content-type",
    "retry-after",
    "retry-after-ms",
    "x-should-retry",
)
HEADERS_TO_REMOVE = "x-envoy-auth-headers-to-remove"
# Envoy's active health check of the check server (a GET, no route has this path): 204 while it
# serves, 503 once it drains (SIGTERM), so Envoy stops sending it checks before it closes. A
# client request with this path is denied: anything but a 200 is.
HEALTH_PATH = "/.llmgw/extauthz/health"
HEALTHY = 204
# Envoy's question at a request's headers, before it reads any of its body (envoy/authn.lua):
# whose key is this? 200 with the tenant in HEADER_TENANT, else the key's refusal (401).
KEY_PATH = "/.llmgw/extauthz/key"
# Set by envoy/authn.lua when the request's body is whole, in milliseconds since the epoch: how
# long the check then waited (in Envoy's queue for this server, and in it) before it is decided.
BODY_AT = wire.HEADER_BODY_AT
# On every answer of a draining server: Envoy fails the host's active health check at once (its
# router reads it on any response), so the next checks go elsewhere before the next interval.
IMMEDIATE_FAIL = "x-envoy-immediate-health-check-fail"

# Every metadata key extauthz answers with, by its type in the contract.
NUMBERS = frozenset(
    {
        wire.META_PRIORITY,
        wire.META_PROMPT_ESTIMATE,
        wire.META_PROMPT_BOUND,
        wire.META_CHOICES,
        wire.META_MAX_OUTPUT,
        wire.META_BORROWED_REQUESTS,
        wire.META_BORROWED_TOKENS,
        wire.META_OUTPUT_CAP,
        wire.META_QUEUE_MS,
        wire.META_KV_BLOCK_SIZE,
    }
)
FLAGS = frozenset(
    {
        wire.META_STREAM,
        wire.META_INCLUDE_USAGE,
        wire.META_FIRST_TURN,
        wire.META_DECIDED,
        wire.META_CIRCUIT_OPEN,
        wire.META_OUTCOME_SOON,
    }
)
STRINGS = frozenset(
    {
        wire.META_TENANT,
        wire.META_TIER,
        wire.META_SESSION,
        wire.META_REQUEST_ID,
        wire.META_KEY_ID,
        wire.META_MODEL,
        wire.META_TOKEN_ESTIMATE,
        wire.META_TOKEN_PROMPT,
        wire.META_TOKEN_CHOICES,
        wire.META_TOKEN_CEILING,
        wire.META_PREFIX_BLOCKS,
        wire.META_KV_BLOCKS,
        wire.META_BODY_SUFFIX,
        wire.META_ALLOWED_MODELS,
        wire.META_SPEND,
        wire.DESTINATION_ENDPOINT,
        wire.META_STATUS,
    }
)
METADATA = NUMBERS | FLAGS | STRINGS


def header_value(value: str) -> str:
    """`value` as a header value: printable ASCII as it is (every value extauthz makes: names
    are validated as such), anything else with its other characters escaped as JSON escapes
    them, so that no value can end a header line."""
    if value.isascii() and value.isprintable():
        return value
    escaped = []
    for char in value:
        if " " <= char <= "~":
            escaped.append(char)
        else:
            escaped.append(f"\\u{ord(char):04x}" if ord(char) < 0x10000 else f"\\U{ord(char):08x}")
    return "".join(escaped)


def metadata_headers(metadata: Mapping[str, Any]) -> Iterable[tuple[str, str]]:
    """The metadata as headers: scalars of the contract's keys; numbers as integers when whole
    (envoy/rewrite.lua formats the output cap with %d)."""
    for key, value in metadata.items():
        if key not in METADATA:
            continue  # a struct (limit overrides): for Envoy's rate-limit filter only
        kind = value.__class__
        if kind is str:
            yield key, header_value(value)
        elif kind is bool:
            yield key, "true" if value else "false"
        elif kind is float or kind is int:
            yield key, str(int(value)) if value == int(value) else repr(float(value))


class Typed(Mapping[str, Any]):
    """ext_authz's metadata read with the contract's types, whichever protocol carried it
    (over gRPC it is typed already), converting only the keys looked up; a number that does not
    parse is missing."""

    __slots__ = ("_meta",)

    def __init__(self, metadata: Mapping[str, Any]) -> None:
        self._meta = metadata

    def __getitem__(self, key: str) -> Any:
        value = self._meta[key]
        if value.__class__ is not str:
            return value
        if key in FLAGS:
            return value == "true"
        if key in NUMBERS:
            try:
                return float(value)
            except ValueError:
                raise KeyError(key) from None
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._meta)

    def __len__(self) -> int:
        return len(self._meta)
