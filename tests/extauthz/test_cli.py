from __future__ import annotations

import argparse
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from extauthz import cli, tenants
from extauthz.decision import Decider
from extauthz.demo import seed_demo
from extauthz.types import Allow, Deny
from tests.extauthz.conftest import TIERS, Keys


def run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="llmgw")
    cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


def test_create_list_revoke(
    tenants_file: Path, keys: Keys, decider: Decider, capsys: pytest.CaptureFixture[str]
) -> None:
    f = str(tenants_file)
    assert run("keys", "create", "--tenant", "acme", "--expires", "30d", "--tenants-file", f) == 0
    api_key = capsys.readouterr().out.strip()
    snap = tenants.load(tenants_file, TIERS)
    entry = snap.keys[tenants.digest(api_key)]
    assert entry.tenant.id == "acme"
    assert entry.expires is not None
    in_30d = (datetime.now(UTC) + timedelta(days=30)).timestamp()
    assert abs(entry.expires - in_30d) < 60
    assert isinstance(decider.decide(snap, {"api-key": api_key}, b"", entry.expires - 1), Allow)

    assert run("keys", "list", "--tenant", "acme", "--tenants-file", f) == 0
    listing = capsys.readouterr().out
    assert entry.key_id in listing and api_key[:13] in listing
    assert api_key not in listing and api_key[13:] not in listing
    assert "revoked" in listing and "expired" in listing

    assert run("keys", "revoke", entry.key_id, "--tenants-file", f) == 0
    snap = tenants.load(tenants_file, TIERS)
    assert isinstance(decider.decide(snap, {"api-key": api_key}, b"", entry.expires - 1), Deny)
    assert not snap.keys[tenants.digest(keys.acme)].revoked  # other keys untouched


def test_tenants_list(tenants_file: Path, keys: Keys, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("tenants", "list", "--tenants-file", str(tenants_file)) == 0
    out = capsys.readouterr().out
    assert "acme" in out and "globex" in out and "gold" in out
    assert keys.acme not in out


def test_errors_exit_1(tenants_file: Path, keys: Keys, capsys: pytest.CaptureFixture[str]) -> None:
    f = str(tenants_file)
    assert run("keys", "create", "--tenant", "nobody", "--tenants-file", f) == 1
    assert run("keys", "revoke", "key_doesnotexist", "--tenants-file", f) == 1
    assert run("keys", "list", "--tenant", "nobody", "--tenants-file", f) == 1
    assert "nobody" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run("keys", "create", "--tenant", "acme", "--expires", "soon", "--tenants-file", f)


def test_default_path_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LLMGW_TENANTS_FILE", str(tmp_path / "t.yaml"))
    assert cli.default_path() == tmp_path / "t.yaml"


def test_seed_demo_one_tenant_per_tier(tenants_file: Path, keys: Keys, decider: Decider) -> None:
    seeded = seed_demo(tenants_file)
    assert [(s["id"], s["tier"]) for s in seeded] == [
        ("demo-free", "free"),
        ("demo-standard", "standard"),
        ("demo-platinum", "platinum"),
    ]
    snap = tenants.load(tenants_file, TIERS)
    for s in seeded:
        d = decider.decide(snap, {"authorization": f"Bearer {s['api_key']}"}, b"", 0)
        assert isinstance(d, Allow) and d.tenant == s["id"]
    assert tenants.digest(keys.acme) in snap.keys  # existing tenants kept
    again = seed_demo(tenants_file)  # re-seeding replaces the demo keys
    snap = tenants.load(tenants_file, TIERS)
    assert tenants.digest(seeded[0]["api_key"]) not in snap.keys
    assert tenants.digest(again[0]["api_key"]) in snap.keys


def test_seed_demo_creates_the_file(tmp_path: Path) -> None:
    assert len(seed_demo(tmp_path / "new.yaml")) == 3


def test_a_running_stacks_file_is_not_edited_while_its_admin_api_owns_the_tenants(
    tenants_file: Path, keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    """`llmgw up` with its admin API: extauthz follows PostgreSQL, the file is imported only at
    the next start; a key revoked in the file would keep working, so the CLI refuses and says
    where to go. Without the API (the ready file says so, or no stack runs), it edits."""
    f = str(tenants_file)
    ready = tenants_file.parent / "ready.json"
    ready.write_text('{"admin_url": "http://127.0.0.1:8086", "admin_token": "t"}')
    before = tenants_file.read_text()
    assert run("keys", "create", "--tenant", "acme", "--tenants-file", f) == 1
    key_id = tenants.load(tenants_file, TIERS).keys[tenants.digest(keys.acme)].key_id
    assert run("keys", "revoke", key_id, "--tenants-file", f) == 1
    err = capsys.readouterr().err
    assert "http://127.0.0.1:8086/admin/v1/" in err and "--no-admin-api" in err
    assert tenants_file.read_text() == before
    ready.write_text('{"admin_url": null}')  # `llmgw up --no-admin-api`
    assert run("keys", "revoke", key_id, "--tenants-file", f) == 0
    ready.unlink()  # no stack runs
    assert run("keys", "create", "--tenant", "acme", "--tenants-file", f) == 0
