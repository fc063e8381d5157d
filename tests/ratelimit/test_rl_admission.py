"""The contract of the two paths to the limiter: extauthz's metadata read inside extauthz
(ratelimit/admission.py) and the descriptors Envoy builds from that same metadata
(ratelimit/descriptors.py, the template's rate_limits) make the same Admission."""

from __future__ import annotations

from typing import Any

import pytest
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2

from llmgw import wire
from llmgw.facts import MetaValue, RequestFacts
from ratelimit.admission import from_metadata
from ratelimit.descriptors import parse
from ratelimit.types import Grant, Limit, Unit

Entry = ratelimit_pb2.RateLimitDescriptor.Entry
LIMIT_REQUESTS, LIMIT_TOKENS = wire.META_LIMIT_REQUESTS, wire.META_LIMIT_TOKENS
Override = ratelimit_pb2.RateLimitDescriptor.RateLimitOverride


def _override(limit: Any) -> Override | None:
    if not isinstance(limit, dict):
        return None
    unit = rls_pb2.RateLimitResponse.RateLimit.Unit.Value(limit["unit"])
    return Override(requests_per_unit=int(limit["requests_per_unit"]), unit=unit)


def envoy_descriptors(meta: dict[str, MetaValue]) -> rls_pb2.RateLimitRequest:
    """What Envoy sends for this metadata (envoy/envoy.yaml.j2's rate_limits): an entry per
    string key present; a descriptor left out when a key it needs is absent."""

    def entries(kind: str, keys: list[str], optional: list[str]) -> list[Entry] | None:
        out = [Entry(key="kind", value=kind)]
        for key in keys:
            if not isinstance(meta.get(key), str):
                return None
            out.append(Entry(key=key, value=str(meta[key])))
        out += [Entry(key=k, value=str(meta[k])) for k in optional if isinstance(meta.get(k), str)]
        return out

    request = rls_pb2.RateLimitRequest(domain=wire.RATELIMIT_DOMAIN)
    shapes = [
        (
            "requests",
            [wire.META_TENANT, wire.META_TIER],
            [wire.META_SESSION],
            wire.META_LIMIT_REQUESTS,
        ),
        (
            "tokens",
            [wire.META_TENANT, wire.META_TIER, wire.META_REQUEST_ID, wire.META_TOKEN_ESTIMATE],
            [wire.META_TOKEN_PROMPT, wire.META_TOKEN_CHOICES],
            LIMIT_TOKENS,
        ),
    ]
    for kind, keys, optional, limit in shapes:
        found = entries(kind, keys, optional)
        if found is not None:
            descriptor = request.descriptors.add(entries=found)
            if (override := _override(meta.get(limit))) is not None:
                descriptor.limit.CopyFrom(override)
    return request


FACTS = RequestFacts(model="m", n=2, max_output=100, prompt_tokens=40).to_metadata()
BASE: dict[str, MetaValue] = {
    **FACTS,
    wire.META_TENANT: "acme",
    wire.META_TIER: "standard",
    wire.META_SESSION: "sess_1",
    wire.META_REQUEST_ID: "req-1",
}
LIMITS: dict[str, MetaValue] = {
    wire.META_LIMIT_REQUESTS: {"requests_per_unit": 100.0, "unit": "MINUTE"},
    wire.META_LIMIT_TOKENS: {"requests_per_unit": 5000.0, "unit": "MINUTE"},
}


@pytest.mark.parametrize(
    "meta",
    [
        BASE,
        {**BASE, **LIMITS},
        {k: v for k, v in BASE.items() if k != wire.META_REQUEST_ID},  # no token check
        {k: v for k, v in BASE.items() if k != wire.META_TOKEN_PROMPT},  # no grant
        {k: v for k, v in BASE.items() if k != wire.META_TENANT},  # nothing to count
    ],
)
def test_the_metadata_and_the_descriptors_make_the_same_admission(
    meta: dict[str, MetaValue],
) -> None:
    assert from_metadata(meta) == parse(envoy_descriptors(meta)).admission


def test_what_the_admission_holds() -> None:
    admission = from_metadata({**BASE, **LIMITS})
    assert admission is not None
    assert (admission.tenant, admission.tier, admission.session) == ("acme", "standard", "sess_1")
    assert admission.token_estimate == 40 + 2 * 100 and admission.grant == Grant(40, 2)
    assert admission.requests_limit == Limit(Unit.MINUTE, 100)
    assert admission.tokens_limit == Limit(Unit.MINUTE, 5000)


@pytest.mark.parametrize(
    "bad",
    [
        {wire.META_TOKEN_ESTIMATE: "12x"},
        {wire.META_TOKEN_ESTIMATE: 12.0},  # not the string Envoy's descriptors need
        {wire.META_LIMIT_REQUESTS: {"requests_per_unit": 5.0, "unit": "FORTNIGHT"}},
        {wire.META_LIMIT_REQUESTS: {"requests_per_unit": True, "unit": "MINUTE"}},
        {wire.META_LIMIT_REQUESTS: "100"},
    ],
)
def test_a_mistyped_fact_is_dropped_as_the_descriptors_drop_it(bad: dict[str, MetaValue]) -> None:
    admission = from_metadata({**BASE, **bad})
    assert admission is not None and admission.tenant == "acme"
    if wire.META_TOKEN_ESTIMATE in bad:
        assert admission.token_estimate is None and admission.grant is None
    else:
        assert admission.requests_limit is None
