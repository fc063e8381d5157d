"""extauthz's edge: an `Answer` to one check, whichever protocol carries it (gRPC:
extauthz/service.py, HTTP: extauthz/httpserver.py). Here alone the typed decision is written as
what Envoy gets: headers, and the metadata (the tenant context, the request facts, what the
limiter decided and the router chose) that Envoy's filters, the router apart and the access log
read."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from extauthz.types import Allow, Deny
from llmgw import wire
from llmgw.facts import MetaValue
from ratelimit.response import admission_metadata, rate_headers, refusal, refusal_status
from ratelimit.types import Verdict
from router.types import PodId, endpoints

_JSON = ("content-type", "application/json")
_RETRY_SOON = (("retry-after", "1"),)


@dataclass(slots=True)
class Answer:
    status: int  # 200: allowed; else the denial's status
    metadata: dict[str, MetaValue]
    client_headers: list[tuple[str, str]]  # allowed: added to the response; denied: the denial's
    headers: Sequence[tuple[str, str]] = ()  # allowed: set on the request to the pod
    headers_to_remove: Sequence[str] = ()
    body: bytes = b""  # denied: the OpenAI error

    @property
    def allowed(self) -> bool:
        return self.status == 200


def metadata(allow: Allow) -> dict[str, MetaValue]:
    """The allowed request's metadata: its tenant context and facts, and what Envoy's Lua
    does to the request (envoy/rewrite.lua)."""
    meta = allow.context.to_metadata()
    meta.update(allow.facts.to_metadata())
    if allow.body_suffix is not None:
        meta[wire.META_BODY_SUFFIX] = allow.body_suffix
    if allow.allowed_models is not None:
        meta[wire.META_ALLOWED_MODELS] = allow.allowed_models
    return meta


def denied(deny: Deny) -> Answer:
    return Answer(deny.status, {}, [_JSON, *deny.headers], body=deny.body())


def model_not_found(allow: Allow, served: Iterable[str]) -> Answer:
    """A model no pod serves, answered as vLLM answers it (vllm/entrypoints/serve/engine/
    serving.py `_check_model`: its envelope, the error class as the type and the status as the
    code), from the fleet's model list, without asking a pod; with the request's metadata, so
    that the tenant's usage shows it (its breaker does not count it: llmgw/breaker.py)."""
    error = {
        "message": f"The model `{allow.facts.model}` does not exist. "
        f"Valid aliases: {', '.join(sorted(served))}.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    body = json.dumps({"error": error}).encode()
    return Answer(404, metadata(allow), [_JSON, *allow.response_headers], body=body)


def refused(allow: Allow, verdict: Verdict) -> Answer:
    """The limiter's refusal as the denial, as the rate-limit filter would have sent it, with
    the session header every answer carries; and the request's facts in the metadata all the
    same, for the access log (Envoy keeps a denied check's metadata; it adds no headers to the
    request it refuses)."""
    headers, body = refusal(verdict)
    meta = metadata(allow)
    meta.update(admission_metadata(verdict))
    return Answer(
        refusal_status(verdict),
        meta,
        [*rate_headers(verdict), *headers, *allow.response_headers],
        body=body,
    )


def admitted(allow: Allow, verdict: Verdict | None) -> Answer:
    """The answer to an allowed request: the limiter's refusal, or the allowance with what the
    limiter decided (its headers to the client, its answer in the metadata); None: the limiter
    did not decide."""
    if verdict is not None and verdict.refusal is not None:
        return refused(allow, verdict)
    answer = Answer(
        200,
        metadata(allow),
        list(allow.response_headers),
        allow.headers,
        allow.headers_to_remove,
    )
    if verdict is not None:
        answer.client_headers += rate_headers(verdict)
        answer.metadata.update(admission_metadata(verdict))
    return answer


def picked(answer: Answer, pods: tuple[PodId, ...]) -> None:
    """The router's pods for the request, best first, where Envoy's override_host reads them."""
    answer.metadata[wire.DESTINATION_ENDPOINT] = endpoints(pods)


def stored(answer: Answer, response_id: str) -> None:
    """The request's response stored under `response_id` (extauthz/responseids.py: base64url,
    nothing to escape): members appended after the decision's "store": false, which the pod's
    parser lets the last of win. A request no pod was chosen for keeps that false: a response
    stored on a pod its ID does not name could never be found."""
    suffix = answer.metadata[wire.META_BODY_SUFFIX]  # a stored response's body is an object
    answer.metadata[wire.META_BODY_SUFFIX] = (
        f'{suffix}, "request_id": "{response_id}", "store": true'
    )


def queued(answer: Answer, waited_s: float, soon: bool) -> None:
    """The wait in flow control's queue, to the client and the ledger (0: none); `soon`: the
    request's outcome wanted at once (Envoy's prompt router log)."""
    ms = round(waited_s * 1000)
    answer.client_headers.append((wire.HEADER_QUEUE_MS, str(ms)))
    answer.metadata[wire.META_QUEUE_MS] = float(ms)
    if soon:
        answer.metadata[wire.META_OUTCOME_SOON] = True


_QUEUE_REFUSALS = {
    "queue_full": "The queue for this model is full: the fleet is saturated. Please retry later.",
    "queue_timeout": "The fleet stayed saturated for as long as this request could wait in the "
    "queue. Please retry later.",
}


def queue_refused(allow: Allow, verdict: Verdict | None, code: str, retry_after_s: int) -> Answer:
    """Flow control's refusal (queue_full, queue_timeout) of an admitted request, with its
    admission in the metadata, as for any denial after one: the ledger releases its reservation
    (a request that never ran is charged nothing)."""
    deny = Deny(429, code, _QUEUE_REFUSALS[code], type="requests", tenant=allow.tenant)
    meta = metadata(allow)
    if verdict is not None:
        meta.update(admission_metadata(verdict))
    headers = [_JSON, ("retry-after", str(retry_after_s)), *allow.response_headers]
    return Answer(429, meta, headers, body=deny.body())


def too_many_bodies(tenant: str, share: int) -> Deny:
    return Deny(
        429,
        "too_many_bodies_in_flight",
        f"Tenant {tenant} has more request bodies in flight than its share of {share} bytes "
        "allows. Please retry shortly.",
        type="requests",  # OpenAI's type of a rate limit on requests
        tenant=tenant,
        headers=_RETRY_SOON,
    )


def overloaded(tenant: str | None) -> Deny:
    return Deny(
        503,
        "overloaded",
        "The gateway is overloaded. Please retry shortly.",
        type="server_error",
        tenant=tenant,
        headers=_RETRY_SOON,
    )
