"""The tenant-context contract: extauthz writes it into metadata, Envoy carries it (a protobuf
Struct over gRPC, headers over HTTP), the router apart and the ledger read it back — the same
context on every side, and the router's request the one the router inside extauthz gets."""

from __future__ import annotations

from dataclasses import replace
from decimal import Decimal
from typing import Any

import pytest

from llmgw import authzhttp, wire
from llmgw.facts import RequestFacts
from llmgw.tenant import TenantContext
from llmgw.tiers import Budget, PerUnit, Spend, TenantSpec
from router.request import from_context, from_metadata
from tests.llmgw.test_facts import through_envoy

WRITTEN = TenantContext(
    tenant="acme",
    tier="gold",
    priority=7,
    session="sess_abc",
    request_id="req-1",
    key_id="key_abcdefgh",
    own=TenantSpec(
        requests=PerUnit(minute=100),
        tokens=PerUnit(minute=50_000),
        budget=Budget(tokens=9000),
        spend=Spend(day=Decimal("1.25"), alert_at=(90,)),
    ),
)
# The limits are Envoy's rate-limit descriptors' to read (tests/ratelimit/test_rl_admission.py),
# the money budgets the ledger's (TenantContext.spend_of).
READ = replace(WRITTEN, own=None)


def over_http(meta: dict[str, Any]) -> authzhttp.Typed:
    """What a reader gets when the check answered over HTTP: headers, read back typed."""
    return authzhttp.Typed(dict(authzhttp.metadata_headers(meta)))


def test_the_context_survives_the_trip_through_envoy() -> None:
    meta = WRITTEN.to_metadata()
    assert TenantContext.from_metadata(through_envoy(meta)) == READ
    assert TenantContext.from_metadata(over_http(meta)) == READ


def test_the_limits_are_written_for_envoys_descriptors() -> None:
    meta = through_envoy(WRITTEN.to_metadata())
    assert meta[wire.META_LIMIT_REQUESTS] == {"requests_per_unit": 100, "unit": "MINUTE"}
    assert meta[wire.META_LIMIT_TOKENS] == {"requests_per_unit": 50_000, "unit": "MINUTE"}
    own = TenantSpec(requests=PerUnit(minute=100))
    assert wire.META_LIMIT_TOKENS not in replace(WRITTEN, own=own).to_metadata()
    assert wire.META_SPEND not in replace(WRITTEN, own=own).to_metadata()


def test_the_tenants_own_money_budgets_reach_the_ledger_both_ways() -> None:
    """The ledger's soft limits read a tenant's own `spend` from its request's metadata."""
    meta = WRITTEN.to_metadata()
    for carried in (through_envoy(meta), over_http(meta)):
        assert TenantContext.spend_of(carried) == Spend(day=Decimal("1.25"), alert_at=(90,))
    assert TenantContext.spend_of({wire.META_SPEND: '{"day": "x"}'}) is None
    assert TenantContext.spend_of({wire.META_SPEND: 3.0}) is None
    assert TenantContext.spend_of({}) is None


@pytest.mark.parametrize(
    "odd",
    [
        {},
        {wire.META_TENANT: 3, wire.META_SESSION: None, wire.META_PRIORITY: "7"},
        {wire.META_PRIORITY: 11.0},
        {wire.META_PRIORITY: 0.0},
        {wire.META_PRIORITY: True},
    ],
)
def test_missing_or_mistyped_metadata_reads_as_defaults(odd: dict[str, Any]) -> None:
    assert TenantContext.from_metadata(odd) == TenantContext()


def test_the_router_apart_reads_what_the_router_inside_is_given() -> None:
    request_facts = RequestFacts(model="m", prompt_tokens=300, prefix_blocks=(1, 2**63))
    meta = through_envoy({**WRITTEN.to_metadata(), **request_facts.to_metadata()})
    asked = from_context(WRITTEN, request_facts)
    assert from_metadata(meta) == asked
    assert (asked.tenant, asked.priority, asked.session, asked.request_id) == (
        "acme",
        7,
        "sess_abc",
        "req-1",
    )
    # Envoy's x-request-id, when the ext_proc request carries it, names the request.
    assert from_metadata(meta, "envoy-1") == replace(asked, request_id="envoy-1")
