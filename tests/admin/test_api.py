"""The admin API's routes and errors, over HTTP, against a real PostgreSQL."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

from admin.__main__ import connect
from admin.routes import ROUTES, Route
from admin.settings import Settings
from admin.store import Store
from extauthz import tenants
from extauthz.types import Tenant
from llmgw.tiers import TierTable
from tests.admin.conftest import OVERLAP_S, Api

PROTECTED = [r for r in ROUTES if r.auth]


def concrete(route: Route) -> str:
    return re.sub(r"{\w+}", "x", route.path)


def assert_error(body: Any, code: str, param: str | None = None) -> None:
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == code, body
    assert body["error"]["param"] == param, body


@pytest.mark.parametrize("route", PROTECTED, ids=lambda r: f"{r.method} {r.path}")
async def test_every_route_refuses_a_missing_or_wrong_token(api: Api, route: Route) -> None:
    for token in ("", "x" * 64, api.token[:-1], api.token + "x"):
        reply = await api.call(route.method, concrete(route), {}, token=token)
        assert reply.status == 401, (token, reply.body)
        assert_error(reply.body, "invalid_api_key")


async def test_an_unknown_route_needs_the_token_before_it_is_found_missing(api: Api) -> None:
    assert (await api.call("GET", "/admin/v1/nothing", token="")).status == 401
    reply = await api.call("GET", "/admin/v1/nothing")
    assert reply.status == 404
    assert_error(reply.body, "not_found")


async def test_a_wrong_method_is_a_405_in_the_error_shape(api: Api) -> None:
    reply = await api.call("PUT", "/admin/v1/tenants")
    assert reply.status == 405
    assert_error(reply.body, "method_not_allowed")
    assert "POST" in reply.headers["Allow"]


async def test_health_metrics_and_the_openapi_document_need_no_token(api: Api) -> None:
    assert (await api.call("GET", "/health", token="")).body == {"status": "ok"}
    await api.ok("GET", "/admin/v1/tenants")
    metrics = (await api.call("GET", "/metrics", token="")).body
    line = 'llmgw_admin_requests_total{route="GET /admin/v1/tenants",status="2xx"} 1.0'
    assert line in metrics
    one = await api.call("GET", "/openapi.json", token="")
    two = await api.call("GET", "/admin/v1/openapi.json", token="")
    assert one.status == two.status == 200 and one.body == two.body


async def test_the_openapi_document_describes_every_route_of_the_table(api: Api) -> None:
    doc = (await api.call("GET", "/openapi.json")).body
    assert doc["openapi"].startswith("3.1")
    described = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    assert described == {(r.method, r.path) for r in ROUTES}
    for route in ROUTES:
        op = doc["paths"][route.path][route.method.lower()]
        assert op["operationId"] == route.operation
        assert bool(op["security"]) == route.auth
        assert {p["name"] for p in op["parameters"] if p["in"] == "query"} == {
            p.name for p in route.query
        }
    tenant = doc["components"]["schemas"]["Tenant"]
    assert "keys" not in tenant["properties"] and "tier" in tenant["required"]
    assert "required" not in doc["components"]["schemas"]["TenantPatch"]


async def test_a_tenant_is_created_read_listed_changed_and_deleted(api: Api) -> None:
    made = await api.tenant("acme", cache_group="acme-group", limits={"rpm": 60})
    assert made["object"] == "tenant" and made["tier"] == "standard" and not made["deleted"]
    assert made["cache_group"] == "acme-group" and made["limits"] == {"rpm": 60, "tpm": None}
    assert await api.ok("GET", "/admin/v1/tenants/acme") == made
    assert [t["id"] for t in (await api.ok("GET", "/admin/v1/tenants"))["data"]] == ["acme"]
    changed = await api.ok("PATCH", "/admin/v1/tenants/acme", {"tier": "platinum", "priority": 9})
    assert (changed["tier"], changed["priority"], changed["name"]) == ("platinum", 9, "acme")
    assert changed["rev"] > made["rev"]
    spec = (await api.rows("SELECT spec FROM tenants WHERE id = 'acme'"))[0]["spec"]
    assert '"platinum"' in spec and "keys" not in spec
    gone = await api.ok("DELETE", "/admin/v1/tenants/acme")
    assert gone["deleted"] and gone["rev"] > changed["rev"]
    assert (await api.call("GET", "/admin/v1/tenants/acme")).status == 404
    assert (await api.ok("GET", "/admin/v1/tenants"))["data"] == []


async def test_a_change_that_changes_nothing_makes_no_revision(api: Api) -> None:
    made = await api.tenant("same")
    again = await api.ok("PATCH", "/admin/v1/tenants/same", {"tier": "standard"})
    assert again["rev"] == made["rev"]
    assert [r["action"] for r in await api.rows("SELECT action FROM audit")] == ["tenant.create"]


TENANT = {"id": "t1", "name": "T", "tier": "standard", "priority": 5, "models": "*"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({k: v for k, v in TENANT.items() if k != "name"}, "name"),
        ({**TENANT, "priority": 11}, "priority"),
        ({**TENANT, "id": "Not A Name"}, "id"),
        ({**TENANT, "models": 3}, "models"),
        ({**TENANT, "limits": {"rpm": 0}}, "limits.rpm"),
        ({**TENANT, "colour": "blue"}, "colour"),
        ({**TENANT, "keys": []}, "keys"),
        ({**TENANT, "tier": "gold"}, "tier"),  # not in the tier table
        ([TENANT], None),
    ],
)
async def test_an_invalid_tenant_is_a_400_naming_the_param(
    api: Api, body: Any, param: str | None
) -> None:
    reply = await api.call("POST", "/admin/v1/tenants", body)
    assert reply.status == 400, reply.body
    assert_error(reply.body, "invalid_value", param)
    assert await api.rows("SELECT * FROM tenants") == []


async def test_an_invalid_change_is_a_400_naming_the_param(api: Api) -> None:
    await api.tenant("t1")
    for body, param in (
        ({"id": "t2"}, "id"),
        ({"tier": "gold"}, "tier"),
        ({"priority": 0}, "priority"),
        ({"keys": []}, "keys"),
    ):
        reply = await api.call("PATCH", "/admin/v1/tenants/t1", body)
        assert reply.status == 400, reply.body
        assert_error(reply.body, "invalid_value", param)
    async with api.session.post(
        api.url + "/admin/v1/tenants",
        data=b"{not json",
        headers={"Authorization": f"Bearer {api.token}"},
    ) as r:
        assert r.status == 400
        assert_error(await r.json(), "invalid_value", None)


async def test_a_duplicate_tenant_is_a_409(api: Api) -> None:
    await api.tenant("dup")
    reply = await api.call("POST", "/admin/v1/tenants", {**TENANT, "id": "dup"})
    assert reply.status == 409
    assert_error(reply.body, "conflict", "id")


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/admin/v1/tenants/nobody"),
        ("PATCH", "/admin/v1/tenants/nobody"),
        ("DELETE", "/admin/v1/tenants/nobody"),
        ("GET", "/admin/v1/tenants/nobody/keys"),
        ("POST", "/admin/v1/tenants/nobody/keys"),
        ("DELETE", "/admin/v1/keys/key_000000000000"),
        ("POST", "/admin/v1/keys/key_000000000000/rotate"),
        ("GET", "/admin/v1/sessions/nothing"),
    ],
)
async def test_an_unknown_id_is_a_404(api: Api, method: str, path: str) -> None:
    reply = await api.call(method, path, {})
    assert reply.status == 404, reply.body
    assert_error(reply.body, "not_found")


async def test_lists_are_paginated_by_id(api: Api) -> None:
    for i in range(5):
        await api.tenant(f"p{i}")
    seen: list[str] = []
    after = None
    pages = 0
    while True:
        page = await api.ok("GET", "/admin/v1/tenants", limit=2, after=after)
        assert page["object"] == "list" and len(page["data"]) <= 2
        seen += [t["id"] for t in page["data"]]
        pages += 1
        if not page["has_more"]:
            break
        after = page["last_id"]
        assert after == page["data"][-1]["id"]
    assert seen == [f"p{i}" for i in range(5)] and pages == 3
    audit = await api.ok("GET", "/admin/v1/audit", limit=3)
    assert audit["has_more"] and len(audit["data"]) == 3
    rest = await api.ok("GET", "/admin/v1/audit", after=audit["last_id"])
    assert [a["target"] for a in audit["data"] + rest["data"]] == seen
    assert not rest["has_more"]
    assert (await api.ok("GET", "/admin/v1/tenants", limit=1000))["data"]
    for limit in (0, 1001, "x", -1):
        reply = await api.call("GET", "/admin/v1/tenants", limit=limit)
        assert reply.status == 400
        assert_error(reply.body, "invalid_value", "limit")
    for after in ("p1", "9" * 30):  # an ID of this list: an integer, a bigint
        reply = await api.call("GET", "/admin/v1/audit", after=after)
        assert_error(reply.body, "invalid_value", "after")


async def test_a_keys_secret_is_returned_once_and_only_its_hash_is_stored(
    api: Api, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    await api.tenant("k")
    made = await api.ok("POST", "/admin/v1/tenants/k/keys", {})
    secret = made["key"]
    assert secret.startswith("sk-llmgw-") and made["id"].startswith("key_")
    assert secret.startswith(made["prefix"]) and len(made["prefix"]) < 16
    digest = hashlib.sha256(secret.encode()).hexdigest()
    row = (await api.rows("SELECT * FROM api_keys"))[0]
    assert row["sha256"] == digest and row["tenant"] == "k" and not row["revoked"]
    rotated = await api.ok("POST", f"/admin/v1/keys/{made['id']}/rotate", {})
    await api.ok("DELETE", f"/admin/v1/keys/{made['id']}")
    listed = await api.ok("GET", "/admin/v1/tenants/k/keys")
    everything = [
        str(listed),
        str(await api.ok("GET", "/admin/v1/tenants/k")),
        str(await api.ok("GET", "/admin/v1/audit")),
        str([dict(r) for r in await api.rows("SELECT * FROM audit")]),
        str([vars(r) for r in caplog.records]),
    ]
    for text in everything:
        for hidden in (secret, digest, rotated["key"], api.token):
            assert hidden not in text
    assert {k["id"] for k in listed["data"]} == {made["id"], rotated["id"]}
    assert all("key" not in k and "sha256" not in k for k in listed["data"])


async def test_a_key_may_expire_at_a_time_in_the_future_only(api: Api) -> None:
    await api.tenant("e")
    at = datetime.now(UTC) + timedelta(days=3)
    made = await api.ok("POST", "/admin/v1/tenants/e/keys", {"expires_at": at.isoformat()})
    assert datetime.fromisoformat(made["expires"]) == at
    for value in ((datetime.now(UTC) - timedelta(seconds=1)).isoformat(), "tomorrow"):
        reply = await api.call("POST", "/admin/v1/tenants/e/keys", {"expires_at": value})
        assert reply.status == 400
        assert_error(reply.body, "invalid_value", "expires_at")


async def test_rotation_makes_a_new_key_and_the_old_one_expires_after_the_overlap(
    api: Api,
) -> None:
    await api.tenant("r")
    old = await api.ok("POST", "/admin/v1/tenants/r/keys")
    before = datetime.now(UTC)
    new = await api.ok("POST", f"/admin/v1/keys/{old['id']}/rotate", {"overlap_seconds": 600})
    after = datetime.now(UTC)
    assert new["key"].startswith("sk-llmgw-") and new["key"] != old["key"]
    assert new["tenant"] == "r" and new["expires"] is None and new["rotated"]["id"] == old["id"]
    rows = {r["id"]: r for r in await api.rows("SELECT * FROM api_keys")}
    expires = rows[old["id"]]["expires"]
    assert before + timedelta(seconds=600) <= expires <= after + timedelta(seconds=600)
    assert datetime.fromisoformat(new["rotated"]["expires"]) == expires
    assert rows[new["id"]]["sha256"] == hashlib.sha256(new["key"].encode()).hexdigest()
    # The service's default overlap, and never later than the key's own expiry.
    again = await api.ok("POST", f"/admin/v1/keys/{new['id']}/rotate")
    default = datetime.fromisoformat(again["rotated"]["expires"]) - datetime.now(UTC)
    assert timedelta(seconds=OVERLAP_S - 60) < default <= timedelta(seconds=OVERLAP_S)
    third = await api.ok("POST", f"/admin/v1/keys/{old['id']}/rotate", {"overlap_seconds": 9999})
    assert datetime.fromisoformat(third["rotated"]["expires"]) == expires
    assert datetime.fromisoformat(third["expires"]) == expires  # no extension by rotation
    # An expired key is no key to rotate.
    await api.rows(
        "UPDATE api_keys SET expires = now() - interval '1 second' WHERE id = $1 RETURNING id",
        again["id"],
    )
    gone = await api.call("POST", f"/admin/v1/keys/{again['id']}/rotate")
    assert gone.status == 409 and "expired" in gone.body["error"]["message"]
    reply = await api.call("POST", f"/admin/v1/keys/{old['id']}/rotate", {"overlap_seconds": -1})
    assert_error(reply.body, "invalid_value", "overlap_seconds")
    await api.ok("DELETE", f"/admin/v1/keys/{old['id']}")
    reply = await api.call("POST", f"/admin/v1/keys/{old['id']}/rotate")
    assert reply.status == 409
    assert_error(reply.body, "conflict")


async def test_revoking_a_key(api: Api) -> None:
    await api.tenant("v")
    key = await api.ok("POST", "/admin/v1/tenants/v/keys")
    revoked = await api.ok("DELETE", f"/admin/v1/keys/{key['id']}")
    assert revoked["revoked"] and revoked["id"] == key["id"]
    assert (await api.rows("SELECT revoked FROM api_keys"))[0]["revoked"]
    assert (await api.ok("GET", "/admin/v1/tenants/v/keys"))["data"][0]["revoked"]


async def test_deleting_a_tenant_leaves_a_tombstone_and_revokes_its_keys(api: Api) -> None:
    await api.tenant("gone")
    await api.tenant("stays")
    keys = [(await api.ok("POST", f"/admin/v1/tenants/{t}/keys"))["id"] for t in ("gone", "gone")]
    other = (await api.ok("POST", "/admin/v1/tenants/stays/keys"))["id"]
    await api.ok("DELETE", "/admin/v1/tenants/gone")
    tenant = (await api.rows("SELECT * FROM tenants WHERE id = 'gone'"))[0]
    assert tenant["deleted"]
    revoked = {r["id"]: r["revoked"] for r in await api.rows("SELECT * FROM api_keys")}
    assert revoked == {keys[0]: True, keys[1]: True, other: False}
    assert (await api.call("POST", "/admin/v1/tenants/gone/keys")).status == 404
    assert (await api.call("DELETE", "/admin/v1/tenants/gone")).status == 404
    audit = await api.rows("SELECT detail FROM audit WHERE action = 'tenant.delete'")
    assert '"revoked_keys"' in audit[0]["detail"]
    # Made anew: a new tenant whose old keys stay revoked.
    again = await api.tenant("gone", tier="free")
    assert not again["deleted"] and again["rev"] > tenant["rev"]
    assert all(k["revoked"] for k in (await api.ok("GET", "/admin/v1/tenants/gone/keys"))["data"])


async def test_every_change_bumps_the_revision_notifies_and_is_audited(api: Api) -> None:
    heard: asyncio.Queue[str] = asyncio.Queue()
    listener = await asyncpg.connect(api.database_url)
    await listener.add_listener("llmgw_tenants", lambda *args: heard.put_nowait(args[3]))
    try:
        key: dict[str, Any] = {}

        async def create_key() -> None:
            key.update(await api.ok("POST", "/admin/v1/tenants/n/keys"))

        async def rotate() -> None:
            key.update(await api.ok("POST", f"/admin/v1/keys/{key['id']}/rotate"))

        changes = [
            ("tenant.create", lambda: api.tenant("n")),
            ("tenant.update", lambda: api.ok("PATCH", "/admin/v1/tenants/n", {"priority": 2})),
            ("key.create", create_key),
            ("key.rotate", rotate),
            ("key.revoke", lambda: api.ok("DELETE", f"/admin/v1/keys/{key['id']}")),
            ("tenant.delete", lambda: api.ok("DELETE", "/admin/v1/tenants/n")),
        ]
        revs = []
        for action, change in changes:
            await change()
            payload = await asyncio.wait_for(heard.get(), 5)
            rev = (await api.rows("SELECT rev FROM tenants WHERE id = 'n'"))[0]["rev"]
            assert payload == str(rev), action
            revs.append(rev)
            last = (await api.rows("SELECT * FROM audit ORDER BY id DESC LIMIT 1"))[0]
            assert (last["action"], last["actor"]) == (action, "admin-token")
            assert last["target"] in ("n", key.get("id"), key.get("rotated", {}).get("id"))
        assert revs == sorted(set(revs))
        assert heard.empty()
    finally:
        await listener.close()


async def test_admin_migrations_are_tracked_apart_from_the_ledgers(api: Api) -> None:
    admin = await api.rows("SELECT version FROM admin_schema_migrations")
    ledger = await api.rows("SELECT version FROM schema_migrations")
    assert [r["version"] for r in admin] == ["0001_admin"]
    assert ledger and not any(r["version"] == "0001_admin" for r in ledger)


async def test_an_import_revokes_and_narrows_but_never_widens_or_revives(api: Api) -> None:
    """The tenants file imported again (the next `llmgw up`): a key it revoked or that expires
    sooner in it is revoked or narrowed in the database (`llmgw keys revoke` between two runs
    sticks); nothing it says widens a key, and a tenant deleted through the API stays deleted."""
    now = datetime.now(UTC).replace(microsecond=0)
    settings = Settings.model_validate({"database_url": api.database_url, "admin_token": api.token})
    pool = await connect(settings)
    try:
        store = Store(pool, lambda: TierTable())
        _, kept = tenants.new_key(now)
        _, dropped = tenants.new_key(now)
        _, narrowed = tenants.new_key(now, now + timedelta(days=30))
        spec = {"name": "F", "tier": "standard", "priority": 5, "models": "*"}
        first = Tenant(id="filed", keys=(kept, dropped, narrowed), **spec)  # type: ignore[arg-type]
        gone = Tenant(id="gone", keys=(), **spec)  # type: ignore[arg-type]
        assert set(await store.import_tenants([first, gone])) == {"filed", "gone"}
        await api.ok("DELETE", "/admin/v1/tenants/gone")
        sooner = now + timedelta(days=1)
        second = first.model_copy(
            update={
                "keys": (
                    kept.model_copy(update={"expires": None}),  # no widening: none to narrow
                    dropped.model_copy(update={"revoked": True}),
                    narrowed.model_copy(update={"expires": sooner}),
                )
            }
        )
        assert await store.import_tenants([second, gone]) == ["filed"]
        rows = {r["id"]: r for r in await api.rows("SELECT * FROM api_keys")}
        assert rows[dropped.id]["revoked"] and rows[narrowed.id]["expires"] == sooner
        assert not rows[kept.id]["revoked"] and rows[kept.id]["expires"] is None
        third = second.model_copy(
            update={"keys": (kept, dropped, narrowed.model_copy(update={"expires": None}))}
        )
        await store.import_tenants([third])  # an unrevoked or longer key in the file: no change
        rows = {r["id"]: r for r in await api.rows("SELECT * FROM api_keys")}
        assert rows[dropped.id]["revoked"] and rows[narrowed.id]["expires"] == sooner
        deleted = await api.rows("SELECT deleted FROM tenants WHERE id = 'gone'")
        assert deleted[0]["deleted"] is True
    finally:
        await pool.close()


@pytest.mark.parametrize(
    ("path", "query", "param"),
    [
        ("/admin/v1/tenants", {"limit": "²"}, "limit"),
        ("/admin/v1/tenants", {"limit": "9" * 5000}, "limit"),
        ("/admin/v1/audit", {"after": "²"}, "after"),
    ],
)
async def test_numbers_are_ascii_digits(
    api: Api, path: str, query: dict[str, str], param: str
) -> None:
    """str.isdigit takes "²", which int() refuses (a 500 before): a 400 naming the param."""
    reply = await api.call("GET", path, **query)
    assert reply.status == 400 and reply.body["error"]["param"] == param


@pytest.mark.parametrize(
    ("method", "path", "query"),
    [
        ("GET", "/admin/v1/tenants/a\x00b", {}),
        ("GET", "/admin/v1/usage", {"tenant": "a\x00b"}),
        ("GET", "/admin/v1/sessions/s\x00", {}),
        ("GET", "/admin/v1/usage", {"since": "0001-01-01T00:00:00+14:00"}),
        ("GET", "/admin/v1/usage", {"until": "0001-01-01T00:00:00+14:00"}),
    ],
)
async def test_a_value_the_database_cannot_hold_is_the_requests_fault(
    api: Api, method: str, path: str, query: dict[str, str]
) -> None:
    """A NUL, or a date PostgreSQL cannot represent: a 400, not "database unavailable"."""
    reply = await api.call(method, path, **query)
    assert reply.status in (400, 404), reply.body
    assert reply.body["error"]["code"] != "unavailable"
