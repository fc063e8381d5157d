"""`llmgw up`'s admin API: started by the stack on its PostgreSQL, reached with the ready file's
URL and token, showing the demo tenants (imported from the stack's tenants file); extauthz
follows the database, so a key made or revoked through the API works or stops through Envoy."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from extauthz import tenants
from tests.e2e.conftest import stack_settings
from tests.e2e.test_ratelimit_e2e import MODEL, chat
from tests.eventually import eventually
from tools.launcher import banner
from tools.stack import Stack

# Prices high enough that a request costs a noticeable share of a small money budget.
PRICES = f"prices: {{currency: USD, models: {{{MODEL}: {{input: 1000, output: 1000}}}}}}\n"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    state = tmp_path_factory.mktemp("admin-stack")
    (state / "tiers.yaml").write_text(PRICES)
    settings = stack_settings().model_copy(
        update={"admin": True, "tiers_file": state / "tiers.yaml"}
    )
    with Stack(settings, state / "stack") as running:
        yield running


def get(url: str, token: str | None, method: str = "GET", body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("content-type", "application/json")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as reply:
            return reply.status, json.load(reply)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def test_the_stack_serves_the_admin_api_with_the_demo_tenants(stack: Stack) -> None:
    info = stack.ready_info()
    url, token = info["admin_url"], info["admin_token"]
    assert url.startswith("http://127.0.0.1:") and len(token) >= 32
    status, listed = get(f"{url}/admin/v1/tenants", token)
    assert status == 200
    demo = {t["id"]: t["tier"] for t in info["tenants"]}
    assert {t["id"]: t["tier"] for t in listed["data"]} == demo
    for tenant in tenants.read(stack.tenants_file).tenants:
        _, keys = get(f"{url}/admin/v1/tenants/{tenant.id}/keys", token)
        assert [k["id"] for k in keys["data"]] == [k.id for k in tenant.keys]
    assert get(f"{url}/admin/v1/tenants", None)[0] == 401
    # The stack's Redis (its password) is the admin's: breaker state is served.
    first = next(iter(demo))
    status, breaker = get(f"{url}/admin/v1/tenants/{first}/breaker", token)
    assert status == 200 and breaker["state"] == "closed", breaker
    assert get(f"{url}/openapi.json", None)[1]["openapi"].startswith("3.1")
    shown = banner(info)
    assert f"{url}/admin/v1/" in shown and token in shown


def test_a_key_made_through_the_api_works_through_envoy_and_stops_when_revoked(
    stack: Stack,
) -> None:
    """The database is the source of truth: extauthz follows it (a notification, else a poll
    every second), so the key works through Envoy as soon as it is made and stops once revoked,
    without anyone touching a file. The bound (2 s) is the follower's; here a busy machine gets
    more before the test gives up."""
    info = stack.ready_info()
    url, token = info["admin_url"], info["admin_token"]
    spec = {"id": "made-by-api", "name": "Made", "tier": "standard", "priority": 5, "models": "*"}
    assert get(f"{url}/admin/v1/tenants", token, "POST", spec)[0] in (200, 201)
    status, made = get(f"{url}/admin/v1/tenants/made-by-api/keys", token, "POST", {})
    assert status in (200, 201)
    key = made["key"]
    eventually(lambda: chat(stack, key).status == 200, 10.0, "the new key works through Envoy")
    assert get(f"{url}/admin/v1/keys/{made['id']}", token, "DELETE")[0] == 200
    eventually(lambda: chat(stack, key).status == 401, 10.0, "the revoked key stops")
    # The demo tenants' keys, imported from the file, work as the banner says.
    demo = next(t for t in info["tenants"] if t["tier"] == "standard")
    assert chat(stack, demo["api_key"]).status == 200


def spend_until_refused(stack: Stack, key: str) -> None:
    """Requests until one is refused (bounded: 40): served at first, then OpenAI's
    insufficient_quota."""
    replies = []
    for _ in range(40):
        replies.append(chat(stack, key))
        if replies[-1].status != 200:
            break
    refused = replies[-1]
    assert refused.status == 429 and len(replies) > 1, [r.status for r in replies]
    assert refused.json()["error"]["code"] == "insufficient_quota", refused.body


def test_a_tenants_own_budget_set_through_the_api_binds_it_through_envoy(stack: Stack) -> None:
    """A token budget in the tenant's spec (its tier, standard, has none) refuses it through
    Envoy once spent, as OpenAI's insufficient_quota; raised through the API, it applies within
    the follower's bound. The tenant beside it, on the same tier, is not refused."""
    info = stack.ready_info()
    url, token = info["admin_url"], info["admin_token"]
    spec = {
        "id": "budgeted", "name": "Budgeted", "tier": "standard", "priority": 5, "models": "*",
        "budget": {"tokens": 80, "per": "day"},
    }  # fmt: skip
    assert get(f"{url}/admin/v1/tenants", token, "POST", spec)[0] in (200, 201)
    shown = get(f"{url}/admin/v1/tenants/budgeted", token)[1]
    assert shown["budget"] == {"tokens": 80, "per": "day"}, shown
    key = get(f"{url}/admin/v1/tenants/budgeted/keys", token, "POST", {})[1]["key"]
    eventually(lambda: chat(stack, key).status != 401, 10.0, "the new key works through Envoy")
    # Each request reserves its prompt and 8 output tokens and is settled at what it used:
    # 80 tokens are a few requests.
    spend_until_refused(stack, key)
    demo = next(t for t in info["tenants"] if t["tier"] == "standard")
    assert chat(stack, demo["api_key"]).status == 200
    raised = {"budget": {"tokens": 1_000_000, "per": "day"}}
    assert get(f"{url}/admin/v1/tenants/budgeted", token, "PATCH", raised)[0] == 200
    eventually(lambda: chat(stack, key).status == 200, 10.0, "the raised budget applies")


def test_a_tenants_own_money_budget_set_through_the_api_is_spent_and_alerted(
    stack: Stack,
) -> None:
    """A money budget in the tenant's spec: spent through Envoy, then refused as
    insufficient_quota; the ledger's soft limit alerts at the spec's own percentage (the budget
    reaches the ledger in the check's metadata, over HTTP here), seen through the API."""
    info = stack.ready_info()
    url, token = info["admin_url"], info["admin_token"]
    spec = {
        "id": "spender", "name": "Spender", "tier": "standard", "priority": 5, "models": "*",
        "spend": {"day": "0.1", "alert_at": [30]},
    }  # fmt: skip
    assert get(f"{url}/admin/v1/tenants", token, "POST", spec)[0] in (200, 201)
    key = get(f"{url}/admin/v1/tenants/spender/keys", token, "POST", {})[1]["key"]
    eventually(lambda: chat(stack, key).status != 401, 10.0, "the new key works through Envoy")
    # A request is ~20 tokens at 0.001 each: 0.1 is a few requests.
    spend_until_refused(stack, key)

    def alerted() -> list[Any]:
        listed = get(f"{url}/admin/v1/alerts?tenant=spender", token)[1]["data"]
        return [a for a in listed if a["kind"] == "alert.spend_threshold"]

    eventually(lambda: bool(alerted()), 10.0, "the soft limit's alert")
    (alert,) = alerted()
    detail = alert["detail"]["detail"]  # the event holds the alert's webhook body
    assert (detail["percent"], detail["budget"], detail["period"]) == (30, "0.1", "day"), alert
