from __future__ import annotations

import asyncio
import time
from decimal import Decimal
from pathlib import Path

import pytest
import yaml

from extauthz import tenants
from extauthz.store import tenants_store
from extauthz.types import KEY_PREFIX
from llmgw.config import ConfigError
from llmgw.reload import RELOADS
from llmgw.tiers import Budget, PerUnit, Spend, TenantSpec
from tests.extauthz.conftest import NOW, TIERS, TIERS_YAML, Keys


def test_keys_have_enough_entropy_and_only_the_hash_is_stored(
    tenants_file: Path, keys: Keys
) -> None:
    assert keys.acme.startswith(KEY_PREFIX)
    assert len(keys.acme) - len(KEY_PREFIX) >= 43  # 256 bits of token_urlsafe
    text = tenants_file.read_text()
    assert keys.acme not in text
    assert keys.acme[len(KEY_PREFIX) + 5 :] not in text
    assert tenants.digest(keys.acme).hex() in text


def test_snapshot_looks_up_by_digest(tenants_file: Path, keys: Keys) -> None:
    snap = tenants.load(tenants_file, TIERS)
    entry = snap.keys[tenants.digest(keys.acme)]
    assert entry.tenant.id == "acme"
    assert entry.key_id == keys.acme_key_id
    assert snap.keys[tenants.digest(keys.revoked)].revoked
    assert snap.tenants["acme"].models == frozenset({"llama-3-8b", "mistral-7b"})
    assert snap.tenants["globex"].models is None


def test_a_tenants_own_limits_and_budgets_are_in_its_view(tenants_file: Path, keys: Keys) -> None:
    """acme's `limits: {rpm: 100}` and its budgets, in the tier table's schema: the request
    carries them to the limiter (tests/ratelimit/test_rl_overrides.py)."""
    snap = tenants.load(tenants_file, TIERS)
    assert snap.tenants["acme"].own == TenantSpec(requests=PerUnit(minute=100))
    assert snap.tenants["globex"].own is None
    spend = {"month": "250.5", "alert_at": [90]}
    _edit(tenants_file, lambda d: d["tenants"][1].update(budget={"tokens": 800}, spend=spend))
    own = tenants.load(tenants_file, TIERS).tenants["globex"].own
    assert own == TenantSpec(
        budget=Budget(tokens=800), spend=Spend(month=Decimal("250.5"), alert_at=(90,))
    )
    assert tenants.load(tenants_file, TIERS).tenants["globex"].token_ceiling == 800


def test_the_token_ceiling_merges_a_tenants_own_limits_by_the_tier_tables_rule(
    tenants_file: Path, keys: Keys
) -> None:
    """The tenants file's tpm and the tier table's own limits for the tenant, merged by one rule:
    each replaces the tier's limit of its unit, the request's last."""
    _edit(tenants_file, lambda d: d["tenants"][0].update(limits={"tpm": 5000}))
    table = TIERS.model_copy(update={"tenants": {"acme": TenantSpec(tokens=PerUnit(minute=9000))}})
    assert tenants.load(tenants_file, table).tenants["acme"].token_ceiling == 5000
    _edit(tenants_file, lambda d: d["tenants"][0].pop("limits"))
    assert tenants.load(tenants_file, table).tenants["acme"].token_ceiling == 9000
    assert tenants.load(tenants_file, TIERS).tenants["acme"].token_ceiling == 400_000  # standard


def _edit(path: Path, change: object) -> None:
    data = yaml.safe_load(path.read_text())
    change(data)  # type: ignore[operator]
    path.write_text(yaml.safe_dump(data))


@pytest.mark.parametrize(
    ("change", "where"),
    [
        (lambda d: d["tenants"][0].update(priority=11), "tenants.0.priority"),
        (lambda d: d["tenants"][0].update(colour="red"), "tenants.0.colour"),
        (lambda d: d["tenants"][1].update(id="acme"), "tenants.1.id"),
        (
            lambda d: d["tenants"][1]["keys"][0].update(id=d["tenants"][0]["keys"][0]["id"]),
            "keys.0.id",
        ),
        (lambda d: d["tenants"][0]["keys"][0].update(sha256="zz"), "tenants.0.keys.0.sha256"),
        (lambda d: d["tenants"][0]["keys"][0].update(created="2025-01-01T00:00:00"), "created"),
        (lambda d: d.update(tiers={"free": {"rpm": 1, "tpm": 1}}), "tier table"),
        (lambda d: d["tenants"][0].update(models="llama"), "tenants.0.models"),
    ],
)
def test_schema_errors_name_the_file_and_key(
    tenants_file: Path, keys: Keys, change: object, where: str
) -> None:
    _edit(tenants_file, change)
    with pytest.raises(ConfigError) as err:
        tenants.read(tenants_file)
    assert str(tenants_file) in str(err.value)
    assert where in str(err.value)


def test_an_empty_tiers_key_of_an_older_file_is_accepted(tenants_file: Path, keys: Keys) -> None:
    _edit(tenants_file, lambda d: d.update(tiers={}))
    assert len(tenants.read(tenants_file).tenants) == 2


def test_a_tier_the_tier_table_lacks_is_refused(tenants_file: Path, keys: Keys) -> None:
    _edit(tenants_file, lambda d: d["tenants"][0].update(tier="diamond"))
    with pytest.raises(ConfigError) as err:
        tenants.load(tenants_file, TIERS)
    assert str(tenants_file) in str(err.value)
    assert "tenants.0.tier" in str(err.value) and "diamond" in str(err.value)


async def test_the_tier_table_reloads_with_the_tenants(
    tenants_file: Path, tiers_file: Path, keys: Keys
) -> None:
    """A tier removed from the tier table while a tenant names it is refused, not silent."""
    store = tenants_store(tenants_file, tiers_file)
    good = store.current
    await asyncio.to_thread(tiers_file.write_text, "tiers: {}\n")  # gold gone, globex names it
    assert not await store.reload_if_changed()
    assert store.current is good
    await asyncio.to_thread(tiers_file.write_text, TIERS_YAML + "  extra: {}\n")
    assert await store.reload_if_changed()
    assert store.current is not good


def _count(result: str) -> float:
    return float(RELOADS.labels("tenants", result)._value.get())


async def test_reload_swaps_and_refuses_a_broken_file(
    tenants_file: Path, tiers_file: Path, keys: Keys
) -> None:
    store = tenants_store(tenants_file, tiers_file)
    before = store.current
    assert not await store.reload_if_changed()  # nothing changed

    new_key, record = tenants.new_key(NOW)
    data = tenants.read(tenants_file)
    acme = data.tenants[0].model_copy(update={"keys": (*data.tenants[0].keys, record)})
    tenants.write(tenants_file, data.model_copy(update={"tenants": (acme, data.tenants[1])}))
    ok = _count("ok")
    assert await store.reload_if_changed()
    assert _count("ok") == ok + 1
    assert tenants.digest(new_key) in store.current.keys
    assert tenants.digest(new_key) not in before.keys  # a request in flight keeps its snapshot

    good = store.current
    failed = _count("failed")
    await asyncio.to_thread(tenants_file.write_text, "tenants: [{id: broken")
    assert not await store.reload_if_changed()
    assert store.current is good
    await asyncio.to_thread(tenants_file.unlink)
    assert not await store.reload_if_changed()
    assert store.current is good
    assert _count("failed") == failed + 2


async def test_watcher_applies_an_edit_within_two_seconds(
    tenants_file: Path, tiers_file: Path, keys: Keys
) -> None:
    store = tenants_store(tenants_file, tiers_file)
    watcher = asyncio.create_task(store.watch(0.25))
    try:
        data = tenants.read(tenants_file)
        acme = data.tenants[0]
        revoked = tuple(k.model_copy(update={"revoked": True}) for k in acme.keys)
        edited = data.model_copy(
            update={"tenants": (acme.model_copy(update={"keys": revoked}), data.tenants[1])}
        )
        started = time.monotonic()
        await asyncio.to_thread(tenants.write, tenants_file, edited)
        while not store.current.keys[tenants.digest(keys.acme)].revoked:
            assert time.monotonic() - started < 2.0, "revocation not applied within 2 s"
            await asyncio.sleep(0.05)
    finally:
        watcher.cancel()


def test_a_broken_file_at_start_is_an_error(tenants_file: Path) -> None:
    tenants_file.write_text("tenants: 3")
    with pytest.raises(ConfigError):
        tenants_store(tenants_file)
