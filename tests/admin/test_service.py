"""`python -m admin` as a process: settings from the environment, the tenants file imported at
start, health, a clean SIGTERM, and logs that never show a key or the token."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from extauthz import tenants
from extauthz.demo import seed_demo
from tools.procs import Process, free_port, http_ok


def request(url: str, token: str, method: str = "GET", body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, method=method)
    req.add_header("Authorization", f"Bearer {token}")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=10) as reply:
            return reply.status, json.load(reply)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def admin(tmp_path: Path, env: dict[str, str]) -> Process:
    overrides = {f"LLMGW_ADMIN__{k}": v for k, v in env.items()}
    url = f"http://127.0.0.1:{env['PORT']}"
    argv = [sys.executable, "-m", "admin"]
    env = {**os.environ, **overrides}
    return Process("admin", argv, http_ok(f"{url}/health"), tmp_path / "admin.log", env)


async def test_the_service_imports_serves_and_stops_on_sigterm(db: str, tmp_path: Path) -> None:
    tenants_file = tmp_path / "tenants.yaml"
    demo = seed_demo(tenants_file)
    token = secrets.token_hex(32)
    port = free_port()
    env = {
        "DATABASE_URL": db,
        "ADMIN_TOKEN": token,
        "PORT": str(port),
        "IMPORT_TENANTS_FILE": str(tenants_file),
    }
    url = f"http://127.0.0.1:{port}/admin/v1"
    proc = admin(tmp_path, env).start(60)
    try:
        status, listed = request(f"{url}/tenants", token)
        assert status == 200
        assert [t["id"] for t in listed["data"]] == sorted(t["id"] for t in demo)
        file_keys = {t.id: [k.id for k in t.keys] for t in tenants.read(tenants_file).tenants}
        for tenant_id, key_ids in file_keys.items():
            _, keys = request(f"{url}/tenants/{tenant_id}/keys", token)
            assert [k["id"] for k in keys["data"]] == key_ids
        status, made = request(f"{url}/tenants/demo-free/keys", token, "POST", {})
        assert status == 200 and made["key"].startswith("sk-llmgw-")
        assert request(f"{url}/tenants", "x" * 64)[0] == 401
    finally:
        code = proc.stop()
    assert code == 0
    log = (tmp_path / "admin.log").read_text()
    assert '"msg": "stopping"' in log and '"route": "POST /admin/v1/tenants/{id}/keys"' in log
    for secret in (token, made["key"], *(t["api_key"] for t in demo)):
        assert secret not in log
    # Started again with the same file: nothing to import, no change audited.
    proc = admin(tmp_path, env).start(60)
    try:
        _, audit = request(f"{url}/audit", token)
    finally:
        proc.stop()
    actions = [a["action"] for a in audit["data"]]
    assert actions == ["tenant.import"] * len(demo) + ["key.create"]
    # Started with a file of new demo keys (the next `llmgw up`): the old ones stop, the key
    # made through the API stays.
    old_keys = {k for ids in file_keys.values() for k in ids}
    seed_demo(tenants_file)
    proc = admin(tmp_path, env).start(60)
    try:
        states = {}
        for tenant_id in file_keys:
            _, keys = request(f"{url}/tenants/{tenant_id}/keys", token)
            states |= {k["id"]: k["revoked"] for k in keys["data"]}
    finally:
        proc.stop()
    assert all(states[k] for k in old_keys) and states[made["id"]] is False
    assert sum(not revoked for revoked in states.values()) == len(demo) + 1


def test_a_weak_or_missing_admin_token_is_refused_at_start() -> None:
    for token, why in (("change-me-" * 4, "placeholder"), ("ab" * 20, "variety"), ("", "")):
        env = {**os.environ, "LLMGW_ADMIN__DATABASE_URL": "postgresql://u:p@127.0.0.1:1/x"}
        if token:
            env["LLMGW_ADMIN__ADMIN_TOKEN"] = token
        done = subprocess.run(
            [sys.executable, "-m", "admin", "--check-config", os.devnull],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 1, done.stdout
        assert "admin_token" in done.stderr and why in done.stderr
        if token:
            assert token not in done.stderr
