"""What the client sees: OpenAI's x-ratelimit-* headers, and the 429 body and retry headers."""

from __future__ import annotations

import json
import math

from llmgw import wire
from llmgw.facts import MetaValue
from llmgw.prices import amount
from ratelimit.types import KindState, Verdict

Headers = list[tuple[str, str]]
# The longest Retry-After the OpenAI SDK honours; past it, it does not retry (OPENAI_COMPAT.md).
SDK_LONGEST_WAIT_MS = 120_000


def go_duration(ms: int) -> str:
    """A duration as Go prints it, as OpenAI's reset headers do: `0s`, `120ms`, `1.5s`, `6m0s`."""
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    whole, frac = divmod(rest, 1000)
    seconds = f"{whole}.{frac:03d}".rstrip("0") if frac else str(whole)
    if hours:
        return f"{hours}h{minutes}m{seconds}s"
    if minutes:
        return f"{minutes}m{seconds}s"
    return f"{seconds}s"


def rate_headers(verdict: Verdict) -> Headers:
    """x-ratelimit-{limit,remaining,reset}-{requests,tokens}; none in shadow mode."""
    if verdict.shadow:
        return []
    out: Headers = []
    for state in (verdict.requests, verdict.tokens):
        if state is not None:
            limit, remaining, reset = wire.RATE_HEADERS[state.kind]
            out += [
                (limit, str(state.limit)),
                (remaining, str(state.remaining)),
                (reset, go_duration(state.reset_ms)),
            ]
    return out


def _per(state: KindState) -> str:
    return f"{state.kind} per {state.unit.value}"


def circuit_open(verdict: Verdict) -> tuple[Headers, bytes]:
    """Headers and the OpenAI error body of the breaker's refusal (Envoy sends it as a 503):
    retry when the cool-down ends, which the SDK does by itself unless it is longer than it
    waits (OPENAI_COMPAT.md)."""
    wait = verdict.retry_after_ms
    error = {
        "message": f"Requests of tenant {verdict.tenant} are failing; its circuit is open for "
        f"{go_duration(wait)}. Please try again then.",
        "type": "server_error",
        "param": None,
        "code": "tenant_circuit_open",
    }
    headers: Headers = [
        ("content-type", "application/json"),
        ("retry-after", str(math.ceil(wait / 1000))),
        ("retry-after-ms", str(wait)),
        ("x-should-retry", "true" if wait <= SDK_LONGEST_WAIT_MS else "false"),
    ]
    return headers, json.dumps({"error": error}, separators=(",", ":")).encode()


def admission_metadata(verdict: Verdict) -> dict[str, MetaValue]:
    """That the limiter decided (the ledger counts admissions without it: fail-open), what the
    admission drew from the borrowing pool, the output cap a hard budget lowered it to (Envoy
    writes it into the body: envoy/rewrite.lua), and whether the tenant's breaker refused it."""
    fields: dict[str, MetaValue] = {wire.META_DECIDED: True}
    if verdict.borrowed_requests or verdict.borrowed_tokens:
        fields[wire.META_BORROWED_REQUESTS] = float(verdict.borrowed_requests)
        fields[wire.META_BORROWED_TOKENS] = float(verdict.borrowed_tokens)
    if verdict.output_cap:
        fields[wire.META_OUTPUT_CAP] = float(verdict.output_cap)
    if verdict.refusal == "circuit_open":
        fields[wire.META_CIRCUIT_OPEN] = True
    return fields


def refusal_status(verdict: Verdict) -> int:
    """The HTTP status of a refusal: the breaker's is a 503 (the tenant's requests are failing),
    every other a 429."""
    return 503 if verdict.refusal == "circuit_open" else 429


def refusal(verdict: Verdict) -> tuple[Headers, bytes]:
    """Headers and the OpenAI error body of a 429: a rate limit (retry after the wait), a request
    too large for any window it could get, or the hard budget spent (both never retried)."""
    if verdict.refusal == "circuit_open":
        return circuit_open(verdict)
    state = verdict.refused
    assert verdict.refusal is not None and state is not None
    headers: Headers = [("content-type", "application/json")]
    if verdict.refusal == "too_large":
        # OpenAI's answer to a request above a limit it could ever fit: retrying cannot help.
        error = {
            "message": f"Request too large for tenant {verdict.tenant} on {_per(state)}: "
            f"Limit {state.limit}, Requested {state.requested}. The input or output tokens "
            "must be reduced in order to run successfully.",
            "type": state.kind,
            "param": None,
            "code": "rate_limit_exceeded",
        }
        headers.append(("x-should-retry", "false"))
    elif verdict.refusal == "insufficient_quota":
        if state.kind == "spend":
            spent = (
                f"spent {amount(state.used)} of its budget of {amount(state.limit)} per "
                f"{state.unit.value} (this request could cost up to {amount(state.requested)})"
            )
        else:
            spent = (
                f"used {state.used} of its budget of {state.limit} tokens per "
                f"{state.unit.value} (requested {state.requested})"
            )
        error = {
            "message": f"You exceeded your current quota: tenant {verdict.tenant} has {spent}.",
            "type": "insufficient_quota",
            "param": None,
            "code": "insufficient_quota",
        }
        headers.append(("x-should-retry", "false"))
    else:
        wait = verdict.retry_after_ms
        error = {
            "message": f"Rate limit reached for tenant {verdict.tenant} on {_per(state)}: "
            f"Limit {state.limit}, Used {state.used}, Requested {state.requested}. "
            f"Please try again in {go_duration(wait)}.",
            "type": verdict.refusal,
            "param": None,
            "code": "rate_limit_exceeded",
        }
        headers += [
            ("retry-after", str(math.ceil(wait / 1000))),
            ("retry-after-ms", str(wait)),
        ]
    body = json.dumps({"error": error}, separators=(",", ":")).encode()
    return headers, body
