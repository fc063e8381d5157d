"""`llmgw up`'s admin API: started by the stack on its PostgreSQL, reached with the ready file's
URL and token, showing the demo tenants (imported from the stack's tenants file)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from extauthz import tenants
from tests.e2e.conftest import stack_settings
from tools.launcher import banner
from tools.stack import Stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with Stack(stack_settings(), tmp_path_factory.mktemp("admin-stack")) as running:
        yield running


def get(url: str, token: str | None) -> tuple[int, Any]:
    req = urllib.request.Request(url)
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
    assert get(f"{url}/openapi.json", None)[1]["openapi"].startswith("3.1")
    shown = banner(info)
    assert f"{url}/admin/v1/" in shown and token in shown
