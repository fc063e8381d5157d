"""From Envoy's access-log entry to an `Outcome`, and what the request costs: pure functions.

The entry carries every filter's dynamic metadata: extauthz's tenant context (llmgw/tenant.py)
and request facts (llmgw/facts.py), the pod's usage and the streamed-event count (`llmgw.usage`,
envoy/usage.lua), the rate limiter's answer (in extauthz's namespace with the limiter inside it,
else in `envoy.filters.http.ratelimit`: that it decided, what it borrowed) and the router's pick
(`envoy.lb`).

Outcome kinds, from what the client finally got (after Envoy's retries):
- `refused`: the request was refused as it stood: by the gateway without asking a pod
  (authentication, quota, bad input, unknown route), or by the pod as invalid (a 4xx);
- `aborted`: the client hung up before the response was complete;
- `upstream_error`: the pod failed (a 5xx), no pod could answer (5xx local replies), or the pod's
  answer broke or timed out after it started (a reset, a timeout, an error event: vLLM's
  mid-stream error);
- `ok`: a complete 2xx or 3xx answer from a pod.

Tokens charged (the settlement's "actual"), never less than what the pod may have generated:
- the pod's usage (prompt + completion) when it arrived;
- a stream cut short: the prompt (the larger of the pod's running usage and the count; before
  the pod reported any, the prompt's bound: its count under the model's tokenizer, else its
  UTF-8 bytes, llmgw/facts.py) plus the tokens that reached the client (the pod's running usage
  when it sends it on every chunk, else one token per content event);
- a non-stream answer cut short, which shows nothing until it is done: the whole reservation
  (prompt estimate plus the output cap), once for each attempt that timed out;
- an error or refusal before any output, or a request that never reached a pod: nothing;
- a complete answer without usage (a pod that does not report it): the reservation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from envoy.data.accesslog.v3 import accesslog_pb2

from llmgw import wire
from llmgw.authzhttp import Typed
from llmgw.facts import RequestFacts
from llmgw.outcome import Outcome, OutcomeKind
from llmgw.structs import View
from llmgw.tenant import TenantContext

# ResponseFlags field → Envoy's short code (as %RESPONSE_FLAGS% prints it).
FLAG_CODES = {
    "failed_local_healthcheck": "LH",
    "no_healthy_upstream": "UH",
    "upstream_request_timeout": "UT",
    "local_reset": "LR",
    "upstream_remote_reset": "UR",
    "upstream_connection_failure": "UF",
    "upstream_connection_termination": "UC",
    "upstream_overflow": "UO",
    "no_route_found": "NR",
    "delay_injected": "DI",
    "fault_injected": "FI",
    "rate_limited": "RL",
    "rate_limit_service_error": "RLSE",
    "downstream_connection_termination": "DC",
    "upstream_retry_limit_exceeded": "URX",
    "stream_idle_timeout": "SI",
    "invalid_envoy_request_headers": "IH",
    "downstream_protocol_error": "DPE",
    "upstream_max_stream_duration_reached": "UMSDR",
    "no_filter_config_found": "NFCF",
    "duration_timeout": "DT",
    "upstream_protocol_error": "UPE",
    "no_cluster_found": "NC",
    "overload_manager": "OM",
    "dns_resolution_failure": "DF",
    "downstream_remote_reset": "DR",
}
_CLIENT_GONE = frozenset({"DC", "DR"})
_TIMED_OUT = frozenset({"UT", "SI", "DT", "UMSDR"})
_STREAM_BROKEN = frozenset({"UR", "UC", "LR", "UPE", "SI", "UT", "UMSDR", "DT"})


def flags(f: accesslog_pb2.ResponseFlags) -> list[str]:
    # Only the flags set (usually none), in field-number order, which is FLAG_CODES' order.
    codes = [FLAG_CODES[d.name] for d, _ in f.ListFields() if d.name in FLAG_CODES]
    if f.HasField("unauthorized_details"):
        codes.append("UAEX")
    return codes


def _ms(d: Any) -> float:
    return float(d.seconds * 1000 + d.nanos / 1e6)


def _int(meta: Mapping[str, Any], key: str) -> int | None:
    v = meta.get(key)
    return int(v) if isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 else None


def _number(meta: Mapping[str, Any], key: str) -> float | None:
    v = meta.get(key)
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 else None


def kind_of(status: int, codes: list[str], pod: str, stream_failed: bool = False) -> OutcomeKind:
    if _CLIENT_GONE.intersection(codes) or status == 0:
        return "aborted"
    if (stream_failed or _STREAM_BROKEN.intersection(codes)) and pod:
        return "upstream_error"
    if status >= 500:
        return "upstream_error"
    return "refused" if status >= 400 or not pod else "ok"


def _namespace(filter_meta: Any, name: str) -> Mapping[str, Any]:
    """Values converted as they are read: most of extauthz's keys are not."""
    found = filter_meta.get(name)
    return View(found) if found is not None else {}


@dataclass(frozen=True, slots=True)
class Entry:
    """What an outcome is made of, read from either of Envoy's access logs: the gRPC stream
    (`from_proto`) or the file (ledger/filelog.py). `authz`, `usage` and `ratelimit` are the
    filters' dynamic metadata namespaces."""

    request_id: str  # Envoy's x-request-id
    start: datetime | None
    status: int
    codes: list[str]
    pod: str  # "ip:port"; "" when no pod was reached
    attempts: int
    ttft_ms: float | None
    duration_ms: float
    path: str
    bytes_in: int
    bytes_out: int
    authz: Mapping[str, Any]
    usage: Mapping[str, Any]
    ratelimit: Mapping[str, Any]


def from_proto(entry: accesslog_pb2.HTTPAccessLogEntry) -> Entry:
    common = entry.common_properties
    filter_meta = common.metadata.filter_metadata
    sock = common.upstream_remote_address.socket_address
    return Entry(
        request_id=entry.request.request_id,
        start=common.start_time.ToDatetime(tzinfo=UTC) if common.HasField("start_time") else None,
        status=entry.response.response_code.value,
        codes=flags(common.response_flags),
        pod=f"{sock.address}:{sock.port_value}" if sock.address else "",
        attempts=common.upstream_request_attempt_count,
        ttft_ms=_ms(common.time_to_first_downstream_tx_byte)
        if common.HasField("time_to_first_downstream_tx_byte")
        else None,
        duration_ms=_ms(common.duration)
        if common.HasField("duration")
        else _ms(common.time_to_last_downstream_tx_byte),
        path=entry.request.path,
        bytes_in=entry.request.request_headers_bytes + entry.request.request_body_bytes,
        bytes_out=entry.response.response_headers_bytes + entry.response.response_body_bytes,
        authz=_namespace(filter_meta, wire.EXTAUTHZ_NAMESPACE),
        usage=_namespace(filter_meta, wire.USAGE_NAMESPACE),
        ratelimit=_namespace(filter_meta, wire.RATELIMIT_NAMESPACE),
    )


def to_outcome(entry: accesslog_pb2.HTTPAccessLogEntry) -> Outcome | None:
    """The gRPC access log's entry's outcome; None for an entry with no request ID."""
    return outcome_of(from_proto(entry))


def outcome_of(entry: Entry) -> Outcome | None:
    """None for an entry with no request ID (nothing to key it by)."""
    authz = Typed(entry.authz)  # strings over HTTP
    path = entry.path.partition("?")[0]
    # Only generation is charged: a stored response read again (GET) shows its usage too.
    generation = path in wire.GENERATION_PATHS
    usage = entry.usage if generation else {}
    # The limiter's answer: the rate-limit filter's, or ext_authz's with the limiter inside it.
    admission = entry.ratelimit or authz
    context = TenantContext.from_metadata(authz)
    request_id = context.request_id or entry.request_id
    if not request_id:
        return None
    facts = RequestFacts.from_metadata(authz)
    status, codes, pod = entry.status, entry.codes, entry.pod
    outcome = kind_of(status, codes, pod, usage.get(wire.META_STREAM_FAILED) is True)
    estimate = str(authz.get(wire.META_TOKEN_ESTIMATE, ""))
    reserved = int(estimate) if estimate.isdigit() else 0
    # What a request that never reported its usage is charged: its prompt and every output
    # token its cap allows — the cap a hard budget lowered it to, if one did; never the history
    # a stored conversation's follow-up reserved beside them (only the pod knows that).
    cap = _int(admission, wire.META_OUTPUT_CAP) or facts.max_output
    reserved = min(reserved, facts.prompt_tokens + cap * max(facts.n, 1))
    prompt = _int(usage, wire.META_PROMPT_TOKENS)
    completion = _int(usage, wire.META_COMPLETION_TOKENS)
    streamed = _int(usage, wire.META_STREAMED_EVENTS) or 0
    answer = (status, codes, entry.attempts, bool(pod))
    prompt_tokens, completion_tokens = (
        charge(outcome, facts, (prompt, completion), streamed, reserved, answer)
        if generation
        else (0, 0)
    )
    return Outcome(
        request_id=request_id,
        ts=entry.start or datetime.now(UTC),
        tenant=context.tenant,
        tier=context.tier,
        session=context.session,
        key_id=context.key_id,
        model=facts.model or "",
        endpoint=wire.endpoint(path),
        pod=pod,
        status=status,
        flags=",".join(codes),
        attempts=entry.attempts,
        stream=facts.stream,
        outcome=outcome,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        cached_tokens=_int(usage, wire.META_CACHED_TOKENS) or 0,
        reserved_tokens=reserved,
        borrowed_requests=_int(admission, wire.META_BORROWED_REQUESTS) or 0,
        borrowed_tokens=_int(admission, wire.META_BORROWED_TOKENS) or 0,
        quota_checked=admission.get(wire.META_DECIDED) is True,
        queue_ms=_number(authz, wire.META_QUEUE_MS),
        ttft_ms=entry.ttft_ms,
        duration_ms=entry.duration_ms,
        bytes_in=entry.bytes_in,
        bytes_out=entry.bytes_out,
        spend=TenantContext.spend_of(authz),
    )


def charge(
    outcome: OutcomeKind,
    facts: RequestFacts,
    usage: tuple[int | None, int | None],
    streamed: int,
    reserved: int,
    answer: tuple[int, list[str], int, bool],
) -> tuple[int, int]:
    """(prompt, completion) tokens the request is charged for; see the module's rules.
    `usage` is the pod's (prompt, completion); `answer` is (status, flags, attempts, whether a
    pod was reached)."""
    prompt, completion = usage
    status, codes, attempts, reached_pod = answer
    if not reached_pod:
        return 0, 0
    timed_out = bool(_TIMED_OUT.intersection(codes))
    if outcome == "aborted" or (outcome == "upstream_error" and (status < 400 or timed_out)):
        if facts.stream:
            asked = facts.prompt_ceiling if prompt is None else max(prompt, facts.prompt_tokens)
            return asked, max(completion or 0, streamed)
        spent = reserved * (max(attempts, 1) if timed_out else 1)
        return facts.prompt_tokens, max(spent - facts.prompt_tokens, 0)
    if outcome != "ok":
        return 0, 0
    if prompt is not None or completion is not None:
        return prompt or 0, completion or 0
    return facts.prompt_tokens, max(reserved - facts.prompt_tokens, 0)
