"""A tenant's own budgets as the admin API stores them (every field of the spec, nulls
included) and extauthz reads them back (extauthz/catalog.py): merged over its tier's by value,
alike from the database, after a tier-table change and from a tenants file, in the limiter and in
the ledger's soft limits."""

from __future__ import annotations

import json
from decimal import Decimal

import pytest

from admin.specs import new_tenant, spec_of
from admin.types import ApiError
from extauthz.catalog import Catalog, Row, parse
from extauthz.types import Tenant
from ledger.spending import SpendAlerts
from llmgw.outcome import Outcome
from llmgw.tenant import TenantContext
from llmgw.tiers import Period, Spend, TierSpec, TierTable
from ratelimit.limits import Limits
from tests.ledger.conftest import outcome

TABLE = TierTable(
    tiers={"t": TierSpec(spend=Spend(day=Decimal(25), month=Decimal(500), alert_at=(90,)))}
)
BODY = {
    "id": "acme", "name": "Acme", "tier": "t", "priority": 5, "models": "*",
    "spend": {"day": "100"},
}  # fmt: skip
BOTH = ((Period.DAY, 100_000_000), (Period.MONTH, 500_000_000))


def stored(body: dict[str, object]) -> Tenant:
    """The tenant as extauthz reads it from the row the admin API wrote."""
    tenant = parse(Row(str(body["id"]), 1, False, json.dumps(spec_of(new_tenant(body, TABLE)))))
    assert tenant is not None
    return tenant


def test_a_stored_spec_keeps_the_tiers_other_period_before_and_after_a_retier() -> None:
    live = Catalog.build([stored(BODY)], TABLE)
    again = live.retier(TABLE)
    for catalog in (live, again):
        own = catalog.snapshot.tenants["acme"].own
        assert Limits(TABLE).policy("acme", "t", own).spend == BOTH


def test_equal_specs_from_the_database_and_a_file_share_one_right_policy() -> None:
    from_db, from_file = stored(BODY).own(), Tenant.model_validate({**BODY, "id": "g"}).own()
    assert from_db == from_file
    limits = Limits(TABLE)
    assert limits.policy("g", "t", from_file).spend == BOTH
    assert limits.policy("acme", "t", from_db).spend == BOTH


def test_the_ledger_keeps_the_tiers_percentages_when_the_spec_states_none() -> None:
    """The tier alerts its month budget at 90 % only; a spec stating a day budget alone keeps
    that (its request's metadata carries no percentages)."""
    meta = TenantContext(tenant="acme", tier="t", own=stored(BODY).own()).to_metadata()
    record: Outcome = outcome(1, tier="t", spend=TenantContext.spend_of(meta))
    alerts = SpendAlerts(lambda: TABLE, lambda *a, **k: None)
    assert alerts.reached(record, [("spend:month", 1, 250_000_000)]) == []
    assert alerts.reached(record, [("spend:month", 1, 450_000_000)]) == [
        (Period.MONTH, 1, 90, 450_000_000, Decimal(500))
    ]
    # The spec's day budget, at the tier's percentages too.
    assert [r[2] for r in alerts.reached(record, [("spend:day", 1, 95_000_000)])] == [90]


@pytest.mark.parametrize(
    ("spend", "field"),
    [
        ({"day": "1", "alert_at": list(range(1, 12))}, "spend.alert_at"),  # more than 10
        ({"day": "1", "alert_at": [50, 50]}, "spend.alert_at"),  # each once
        ({"day": "1", "alert_at": []}, "spend.alert_at"),
        ({"day": "0.0000004"}, "spend.day"),  # finer than a micro-unit
    ],
)
def test_a_spend_every_request_could_not_carry_cheaply_is_a_400(
    spend: dict[str, object], field: str
) -> None:
    with pytest.raises(ApiError) as refused:
        new_tenant({**BODY, "spend": spend}, TABLE)
    assert refused.value.status == 400 and refused.value.param == field


def test_percentages_are_kept_sorted() -> None:
    assert Spend(day=Decimal(1), alert_at=(100, 25)).alert_at == (25, 100)
    assert Spend(day=Decimal(1)).percentages == (50, 80, 100)
