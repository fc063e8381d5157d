"""Render and validate the Envoy configuration from envoy/envoy.yaml.j2."""

from __future__ import annotations

import ipaddress
import subprocess
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import jinja2
from pydantic import Field, model_validator

from llmgw import authzhttp, wire
from llmgw.config import Strict
from llmgw.topology import Topology
from tools.procs import bin_path

TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "envoy"
TEMPLATE = "envoy.yaml.j2"

# The OpenAI endpoints served by the pods; any other path is a 404 in OpenAI's shape.


class Address(Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535)

    @property
    def cluster_type(self) -> str:
        """Envoy's cluster type for this address: a name (compose, Kubernetes) is resolved."""
        return "STATIC" if _is_ip(self.host) else "STRICT_DNS"


class Timeouts(Strict):
    connect: str = "1s"
    # No bytes from the pod for this long ends the attempt (and retries it if nothing was sent yet).
    # Non-stream requests send nothing until the whole completion is generated: keep it generous.
    upstream_idle: str = "300s"
    stream_idle: str = "300s"
    request_headers: str = "10s"
    request: str = "30s"  # to receive the whole request, body included (not the response)
    connection_idle: str = "3600s"


class Retries(Strict):
    attempts: int = 2
    backoff_base: str = "0.025s"
    backoff_max: str = "0.25s"


class Health(Strict):
    interval: str = "1s"
    timeout: str = "1s"
    unhealthy_threshold: int = 2
    healthy_threshold: int = 1


class Outlier(Strict):
    consecutive_5xx: int = 5
    consecutive_gateway_failure: int = 3
    interval: str = "1s"
    base_ejection_time: str = "5s"
    max_ejection_time: str = "60s"
    max_ejection_percent: int = 50


class Circuit(Strict):
    max_connections: int = 4096
    max_pending_requests: int = 4096
    max_requests: int = 4096
    retry_budget_percent: float = 25.0
    min_retry_concurrency: int = 32


class Uploads(Strict):
    """What a caller may make Envoy hold before its body is whole (envoy/authn.lua), per Envoy
    worker: a request's body counts from its headers (its content-length, else
    max_request_bytes) until it is whole or answered."""

    tenant_bytes: int = Field(default=128 * 1024 * 1024, gt=0)  # one tenant's uploads
    total_bytes: int = Field(default=512 * 1024 * 1024, gt=0)  # everyone's
    # A client that resets mid-upload sends no signal: its count goes after this (above the
    # request timeout, which ends every upload).
    upload_ms: int = Field(default=35_000, gt=0)
    # extauthz's answer to "whose key is this?" is reused this long per worker: a revoked key
    # may make Envoy buffer for this long (the check with the body refuses it all the same).
    key_cache_ms: int = Field(default=1000, ge=0)
    # The key question's own wait (extauthz sheds it first, after its shed_after_ms).
    key_timeout_ms: int = Field(default=2000, gt=0)
    key_cache_entries: int = Field(default=10_000, gt=0)


class Services(Strict):
    """Where the callout services listen, in which topology; a service left out is not in the
    config."""

    # How Envoy asks for the check, and where the rate limiter and the router run
    # (llmgw/topology.py): inside extauthz, or at `ratelimit` (rls) and `router` (epp).
    topology: Topology = Topology.GATEWAY
    extauthz: Address | None = None
    # extauthz's HTTP port (its settings `http_port`): Envoy asks it whose key a request carries
    # at the headers (authzhttp.KEY_PATH) and, in the gateway topology, checks there too,
    # without grpc-python's plumbing per check (llmgw/authzhttp.py).
    extauthz_http: Address | None = None
    ratelimit: Address | None = None
    router: Address | None = None
    ledger: Address | None = None  # the access-log service: outcomes, settlement, usage ledger
    # A router picks where the topology puts it; False: none does, and Envoy's fallback policy
    # picks alone (chains built up one service at a time, in benchmarks).
    routed: bool = True
    # Long enough to mean "down", not "busy": a burst of 1,000 requests queues up its checks on
    # one core (tests/e2e/test_burst.py). extauthz fails closed (503), and bounds its own admission
    # below this (its admit_timeout_ms); the rate limiter apart fails open, so a timeout that
    # fired while it was merely busy would admit unchecked.
    timeout: str = Field(default="2s", pattern=r"^\d+(\.\d+)?m?s$")
    # With the router inside extauthz, flow control holds a check while its request waits for a
    # seat (extauthz's flow.max_wait_s; 0: flow control off): Envoy waits this much longer.
    queue_wait_s: float = Field(default=20.0, ge=0)
    # The checks flow control may hold at once (its flow.max_queued, times the replicas): each
    # keeps its connection to extauthz's HTTP port, so Envoy opens this many more.
    queued_checks: int = Field(default=1024, ge=0)
    ratelimit_timeout: str = "2s"
    router_timeout: str = "0.2s"  # fail open: Envoy's fallback picks
    # Access-log batches to the ledger, and to the router those it does not want at once, at
    # least this often.
    log_flush: str = "0.2s"
    # The router's, sooner, for the requests flow control wants the outcome of at once (seats may
    # run out: wire.META_OUTCOME_SOON): an ended request frees its seat for the queue when its
    # entry arrives, before the next scrape shows it (router/fleet.py `ended`).
    router_log_flush: str = "0.02s"
    # Entries Envoy holds per logger and worker while the service reads slower than it logs (a
    # burst): past this it drops them (access_logs.grpc_access_log.logs_dropped). Envoy's
    # default, 16 KiB, is a handful of entries: a burst of 200 requests lost some.
    log_buffer_bytes: int = Field(default=4 * 1024 * 1024, gt=0)

    @model_validator(mode="after")
    def _fits_the_topology(self) -> Services:
        name = self.topology.value
        if (self.extauthz is None) != (self.extauthz_http is None):
            raise ValueError(
                "extauthz, extauthz_http: both or neither (its gRPC port: health, the router's "
                "access log; its HTTP port: whose key a request carries, before any body is read)"
            )
        if self.ratelimit is not None and self.topology.limiter_inside:
            raise ValueError(f"ratelimit: {name} has the rate limiter inside extauthz (rls: apart)")
        if self.router is not None and self.topology.router_inside:
            raise ValueError(f"router: {name} has the router inside extauthz (epp: apart)")
        if self.router is not None and not self.routed:
            raise ValueError("router: an address, and routed: false")
        if self.extauthz is not None and self.topology is Topology.RLS and self.ratelimit is None:
            raise ValueError("rls: needs the rate limiter's address (ratelimit)")
        if self.routed and self.topology is Topology.EPP and self.router is None:
            raise ValueError("epp: needs the router's address (router)")
        return self

    @property
    def check_timeout(self) -> str:
        """Envoy's wait for extauthz's check: its own bound, and flow control's queue's."""
        ms = self.timeout.endswith("ms")
        own = float(self.timeout.removesuffix("ms")) / 1000 if ms else float(self.timeout[:-1])
        return f"{own + (self.queue_wait_s if self.router_inside else 0):g}s"

    @property
    def check_connections(self) -> int:
        """Envoy's connections to extauthz's HTTP port: 64 checks at once gain nothing more on
        one event loop (a burst would make it handshake each new one), and the queued ones."""
        return 64 + (self.queued_checks if self.router_inside and self.queue_wait_s else 0)

    @property
    def check_over_http(self) -> bool:
        return self.extauthz is not None and self.topology.check_over_http

    @property
    def limiter_inside(self) -> bool:
        return self.extauthz is not None and self.topology.limiter_inside

    @property
    def router_inside(self) -> bool:
        """The pick in ext_authz's metadata, the router's access log to extauthz."""
        return self.extauthz is not None and self.topology.router_inside and self.routed

    @property
    def admission_namespace(self) -> str:
        """Where the limiter's answer (wire.META_DECIDED, ...) is in the dynamic metadata."""
        return wire.EXTAUTHZ_NAMESPACE if self.limiter_inside else wire.RATELIMIT_NAMESPACE

    @property
    def grpc(self) -> list[tuple[str, Address]]:
        named = (
            ("extauthz", self.extauthz),
            ("ratelimit", self.ratelimit),
            ("router", self.router),
            ("ledger", self.ledger),
        )
        return [(name, a) for name, a in named if a is not None]


# What the stats listener serves from the admin: readiness for probes, metrics for scrapers.
STATS_PATHS = ("/ready", "/stats/prometheus")


class UpstreamTls(Strict):
    """Envoy's side of mutual TLS with the services (tools/certs.py), as paths Envoy reads: its
    client certificate and key, and the CA each service's certificate must chain to. Each
    service's must also carry the service's name (its cluster's) as a SAN."""

    cert: str
    key: str
    ca: str
    # Envoy's connect timeout to the services, which includes the handshake: a burst of new
    # connections is handshaken one at a time by a service's event loop. Measured: a cold burst
    # of 200 checks on a loaded 2-core box, 162 of 242 connections timed out at 0.25 s; one of
    # 1,000 (flow control lets a connection per check be open) timed out at 1 s under CI's load
    # and three CPU burners here. Past the shed's 1 s, a check that connects late is answered
    # 503 overloaded by extauthz (a decision, with retry-after), not timed out by Envoy (the
    # key question's own 2 s ends sooner: 503 overloaded too). A service that is down refuses
    # the connection at once on loopback or where the network rejects it; where packets to it
    # are dropped, each new connection waits this long (health checks then mark it down).
    connect_timeout: str = "5s"


class EnvoySettings(Strict):
    # Loopback only: the admin stops Envoy (/quitquitquit), dumps its config, changes log levels.
    admin: Address = Address()
    # A listener serving only STATS_PATHS from the admin, for probes and Prometheus; None: none.
    stats: Address | None = None
    # The environment variable (Envoy's) holding the pods' vLLM --api-key, sent to them as
    # `authorization: Bearer KEY`; None: the pods take requests without a key.
    pod_key_env: str | None = Field(default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    timeouts: Timeouts = Timeouts()
    retries: Retries = Retries()
    health: Health = Health()
    outlier: Outlier = Outlier()
    circuit: Circuit = Circuit()
    max_request_bytes: int = Field(default=8 * 1024 * 1024, gt=0)
    uploads: Uploads = Uploads()
    max_downstream_connections: int = 50_000
    max_streams_per_connection: int = Field(default=128, gt=0)  # HTTP/2 clients
    # Envoy sheds new requests above 95 % of this (bodies are buffered in memory).
    max_heap_bytes: int = Field(default=2 * 1024**3, gt=0)
    slow_start: str = "5s"
    # Envoy's own pick when the router names no pod (no router, router down).
    fallback_policy: Literal["least_request", "round_robin"] = "least_request"
    concurrency: int = 2
    access_log_path: str | None = None
    otlp: Address | None = None  # an OpenTelemetry collector (OTLP/gRPC); None: no tracing
    tracing_percent: float = Field(default=100.0, ge=0, le=100)
    # Mutual TLS to extauthz, the rate limiter, the router and the ledger; None: plaintext, and
    # whoever reaches their ports can report outcomes (tests of one service only).
    tls: UpstreamTls | None = None

    @model_validator(mode="after")
    def _admin_on_loopback(self) -> EnvoySettings:
        if not (_is_ip(self.admin.host) and ipaddress.ip_address(self.admin.host).is_loopback):
            raise ValueError(
                f"admin: {self.admin.host} is not a loopback address; Envoy's admin can stop it "
                "and dump its config. Expose readiness and metrics with `stats` instead."
            )
        return self


def parse_endpoint(spec: str) -> Address:
    """`host:port` or `http://host:port[/...]` → Address."""
    parts = urlsplit(spec if "//" in spec else f"//{spec}")
    if parts.scheme not in ("", "http") or not parts.hostname or parts.port is None:
        raise ValueError(f"upstream {spec!r}: expected host:port or http://host:port")
    return Address(host=parts.hostname, port=parts.port)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _reply(
    status: int | None,
    message: str,
    kind: str,
    code: str | None = None,
    flags: tuple[str, ...] = (),
    retry_after: int | None = None,
) -> dict[str, Any]:
    """A mapper; `status` None matches every status (with `flags`); `kind` "passthrough" keeps
    the reply's own body (ours, already in the OpenAI envelope); `retry_after`, seconds, added."""
    return {
        "status": status,
        "message": message,
        "type": kind,
        "code": code,
        "flags": flags,
        "retry_after": retry_after,
    }


def _local_replies(max_request_bytes: int) -> list[dict[str, Any]]:
    """Mappers for Envoy's own replies, first match wins; flags narrow a mapper to one cause."""
    body = "%LOCAL_REPLY_BODY%"
    return [
        _reply(400, body, "invalid_request_error", flags=("DPE",)),
        # extauthz's 404 (a model no pod serves: vLLM's own body) is no unknown URL.
        _reply(404, body, "passthrough", flags=("UAEX",)),
        _reply(404, "Invalid URL (%REQ(:METHOD)% %REQ(:PATH)%)", "invalid_request_error"),
        _reply(
            413,
            f"Request body too large: the limit is {max_request_bytes} bytes.",
            "invalid_request_error",
            "request_too_large",
        ),
        _reply(
            408,
            "The request was not received in time.",
            "invalid_request_error",
            "request_timeout",
        ),
        _reply(431, body, "invalid_request_error"),
        _reply(500, body, "server_error"),
        _reply(502, body, "server_error"),
        # The check failed (extauthz down, or not answering within the check's timeout): the
        # same answer as envoy/authn.lua's, with a retry-after the SDK follows.
        _reply(
            503,
            "The authorization service is unavailable; please retry.",
            "server_error",
            "authorization_unavailable",
            flags=("UAEX",),
            retry_after=1,
        ),
        # extauthz's own denials: already OpenAI errors, kept as they are by the mappers below.
        _reply(None, body, "passthrough", flags=("UAEX",)),
        _reply(
            503,
            f"The model servers are unavailable or overloaded: {body}",
            "server_error",
            "server_is_overloaded",
        ),
        _reply(504, body, "server_error", "timeout"),
        # Envoy's codec and path checks (escaped slashes, HTTP/1.0, malformed requests).
        _reply(400, "Bad request (%RESPONSE_CODE_DETAILS%).", "invalid_request_error"),
        _reply(426, "HTTP/1.1 or HTTP/2 is required.", "invalid_request_error"),
    ]


# The pod's usage fields copied into metadata (wire.USAGE_NAMESPACE): key, path to the value.
# Chat and completions name them in `usage`; the Responses API otherwise, and its stream in the
# `response.completed` event's response (a body has one usage, so at most one path matches).
_USAGE_NAMES = (
    (wire.META_PROMPT_TOKENS, ("prompt_tokens",), ("input_tokens",)),
    (wire.META_COMPLETION_TOKENS, ("completion_tokens",), ("output_tokens",)),
    (
        wire.META_CACHED_TOKENS,
        ("prompt_tokens_details", "cached_tokens"),
        ("input_tokens_details", "cached_tokens"),
    ),
)
USAGE_FIELDS = tuple(
    (key, ("usage", *names)) for key, chat, responses in _USAGE_NAMES for names in (chat, responses)
)
STREAM_USAGE_FIELDS = (
    *USAGE_FIELDS,
    *((key, ("response", "usage", *responses)) for key, _, responses in _USAGE_NAMES),
)


def render(
    settings: EnvoySettings, listen: Address, pods: list[Address], services: Services | None = None
) -> str:
    if not pods:
        raise ValueError("at least one pod is needed")
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATE_DIR),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )
    # Exact methods: generation is POST only, the model list GET only; anything else is a 404.
    post = '[{name: ":method", string_match: {exact: POST}}]'
    get = '[{name: ":method", string_match: {exact: GET}}]'
    response = wire.RESPONSE_PREFIX + "[^/]+"
    cancel = response + wire.CANCEL_SUFFIX
    routes = [
        {"match": f'{{path: "{p}", headers: {post}}}', "body": True} for p in wire.GENERATION_PATHS
    ] + [
        {"match": f'{{path: "{wire.MODELS_PATH}", headers: {get}}}', "body": False},
        {"match": f'{{prefix: "{wire.MODELS_PATH}/", headers: {get}}}', "body": False},
        # A stored response (extauthz refuses these where the gateway keeps none).
        {"match": f'{{safe_regex: {{regex: "{response}"}}, headers: {get}}}', "body": False},
        {"match": f'{{safe_regex: {{regex: "{cancel}"}}, headers: {post}}}', "body": False},
    ]
    return env.get_template(TEMPLATE).render(
        wire=wire,
        authzhttp=authzhttp,
        settings=settings,
        listen=listen,
        routes=routes,
        services=services or Services(),
        local_replies=_local_replies(settings.max_request_bytes),
        usage_fields=USAGE_FIELDS,
        stream_usage_fields=STREAM_USAGE_FIELDS,
        stats_paths=STATS_PATHS,
        pods={
            "cluster_type": "STATIC" if all(_is_ip(p.host) for p in pods) else "STRICT_DNS",
            "endpoints": pods,
        },
    )


def validate(path: Path) -> None:
    """`envoy --mode validate`; raises ValueError with Envoy's message when the file is refused."""
    result = subprocess.run(
        [bin_path("envoy"), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if result.returncode != 0:
        raise ValueError(f"{path}: envoy refused the config:\n{result.stdout}{result.stderr}")
