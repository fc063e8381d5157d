"""The limits config: validation, defaults, overrides; the offline config check."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest

from llmgw.config import ConfigError
from llmgw.tiers import (
    Budget,
    PerUnit,
    Spend,
    TenantSpec,
    TierSpec,
    TierTable,
    load_tiers,
    watched_tiers,
)
from ratelimit.limits import Limits, TableLimits, kept, own_limits
from ratelimit.settings import Settings
from ratelimit.types import Limit, Period, Unit

GOOD = """
default_tier: free
tiers:
  gold:
    requests: {second: 200, minute: 6000}
    tokens: {minute: 1000000, day: unlimited}
    budget: {tokens: 5000000, per: day}
    borrow_share: 0.75
tenants:
  acme: {tokens: {minute: 5000}, shadow: true}
"""


def test_good_file(tmp_path: Path) -> None:
    path = tmp_path / "limits.yaml"
    path.write_text(GOOD)
    limits = Limits(load_tiers(path))
    gold = limits.policy("someone", "gold")
    assert gold.requests == (Limit(Unit.SECOND, 200), Limit(Unit.MINUTE, 6000))
    assert gold.tokens == (Limit(Unit.MINUTE, 1_000_000),)
    assert gold.budget == Limit(Unit.DAY, 5_000_000) and not gold.shadow
    acme = limits.policy("acme", "gold")
    assert acme.tokens == (Limit(Unit.MINUTE, 5000),) and acme.shadow
    assert limits.policy("x", "no-such-tier").tier == "free"
    assert limits.policy("x", "platinum").borrow_share == 1.0


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("tiers: {gold: {requests: {fortnight: 5}}}", "tiers.gold.requests.fortnight"),
        ("tiers: {gold: {requests: {minute: -1}}}", "tiers.gold.requests.minute"),
        ("tiers: {gold: {tokens: {minute: lots}}}", "tiers.gold.tokens.minute"),
        ("tiers: {gold: {borrow_share: 2}}", "tiers.gold.borrow_share"),
        ("tiers: {gold: {budget: {tokens: 5, per: week}}}", "tiers.gold.budget.per"),
        ("default_tier: gold", "default_tier"),
        ("tenants: {acme: {tier: gold}}", "tenants.acme.tier"),
    ],
)
def test_bad_files_name_file_and_key(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "limits.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_tiers(path)
    assert str(path) in str(err.value)
    assert key.split(".")[-1] in str(err.value)


def test_check_config_cli(tmp_path: Path) -> None:
    limits = tmp_path / "limits.yaml"
    limits.write_text(GOOD)
    settings = tmp_path / "ratelimit.yaml"
    settings.write_text(f"tiers_file: {limits}\nfailover: {{deadline_ms: 15}}\n")
    run = [sys.executable, "-m", "ratelimit", "--check-config", str(settings)]
    assert subprocess.run(run, capture_output=True).returncode == 0
    limits.write_text("tiers: {gold: {requests: {minute: -3}}}")
    bad = subprocess.run(run, capture_output=True, text=True)
    assert bad.returncode == 1 and str(limits) in bad.stderr and "minute" in bad.stderr


def test_a_tier_removed_from_the_table_is_kept_not_put_on_the_default(tmp_path: Path) -> None:
    """A tenant may still name it; the default tier (free: 600/min) would raise its limits."""
    table = tmp_path / "tiers.yaml"
    table.write_text("tiers: {small: {requests: {minute: 40}}}\n")
    first = kept(load_tiers(table), None)
    table.write_text("tiers: {}\n")
    after = kept(load_tiers(table), first)
    assert after.policy("acme", "small").requests == (Limit(Unit.MINUTE, 40),)
    assert kept(load_tiers(table), None).policy("acme", "small").tier == "free"  # at a restart


async def test_an_undecodable_file_is_refused_and_the_watch_goes_on(tmp_path: Path) -> None:
    table = tmp_path / "tiers.yaml"
    table.write_text("tiers: {small: {requests: {minute: 40}}}\n")
    tiers = watched_tiers(table)
    limits = TableLimits(tiers.get)
    watch = asyncio.create_task(tiers.watch(0.01))
    try:
        table.write_bytes(table.read_bytes() + b"\xff")  # not UTF-8: once killed the watcher
        await asyncio.sleep(0.2)
        assert not watch.done()
        assert limits.policy("acme", "small").requests == (Limit(Unit.MINUTE, 40),)
        table.write_text("tiers: {small: {requests: {minute: 7}}}\n")
        for _ in range(100):
            if limits.policy("acme", "small").requests == (Limit(Unit.MINUTE, 7),):
                break
            await asyncio.sleep(0.02)
        assert limits.policy("acme", "small").requests == (Limit(Unit.MINUTE, 7),)
    finally:
        watch.cancel()


def test_the_old_setting_names_are_read_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`limits_file` and the Redis deadlines under `redis` still load, as their new names."""
    old = {"limits_file": str(tmp_path), "redis": {"port": 7000, "deadline_ms": 15}}
    settings = Settings.model_validate(old)
    assert settings.tiers_file == tmp_path and settings.redis.port == 7000
    assert settings.failover.deadline_ms == 15
    assert "limits_file is deprecated: use tiers_file" in caplog.text
    assert "redis.deadline_ms is deprecated: use failover.deadline_ms" in caplog.text
    assert old["redis"] == {"port": 7000, "deadline_ms": 15}  # the caller's input left whole
    with pytest.raises(ValueError, match="set only tiers_file"):
        Settings.model_validate({"limits_file": "a", "tiers_file": "b"})


def test_a_tenants_own_limits_merge_alike_stated_in_the_table_or_carried_by_the_request() -> None:
    """One rule for a tenant's own limits, wherever they come from: the tier table's `tenants:`
    entry, or the request (the tenant's spec, as extauthz passes it or Envoy's descriptors carry
    its per-minute limits, over the table's entry): each replaces the tier's of its unit."""
    gold = TierSpec(requests=PerUnit(second=200, minute=6000), tokens=PerUnit(minute=10**6))
    table = TierTable(tiers={"gold": gold})
    own = TenantSpec(requests=PerUnit(minute=100), tokens=PerUnit(minute=5000))
    stated = Limits(table.model_copy(update={"tenants": {"acme": own}})).policy("acme", "gold")
    carried = Limits(table).policy(
        "acme", "gold", own_limits(Limit(Unit.MINUTE, 100), Limit(Unit.MINUTE, 5000))
    )
    assert stated == carried
    assert carried.requests == (Limit(Unit.SECOND, 200), Limit(Unit.MINUTE, 100))
    assert carried.tokens == (Limit(Unit.MINUTE, 5000),)
    both = Limits(table.model_copy(update={"tenants": {"acme": own}}))
    seven = TenantSpec(requests=PerUnit(minute=7))
    assert both.policy("acme", "gold", seven).requests[1] == Limit(Unit.MINUTE, 7)


def test_a_tenants_own_budgets_carried_by_the_request_merge_over_its_tiers() -> None:
    """The tenant's spec's budgets (the admin API's): its token budget replaces its tier's, its
    money budgets merge period by period; tenants with the same spec share one policy."""
    table = TierTable(
        tiers={"t": TierSpec(budget=Budget(tokens=10**6), spend=Spend(month=Decimal(500)))}
    )
    own = TenantSpec(budget=Budget(tokens=900, per=Unit.HOUR), spend=Spend(day=Decimal(2)))
    limits = Limits(table)
    policy = limits.policy("acme", "t", own)
    assert policy.budget == Limit(Unit.HOUR, 900)
    assert policy.spend == ((Period.DAY, 2_000_000), (Period.MONTH, 500_000_000))
    assert limits.policy("globex", "t", own) is policy
    assert limits.policy("acme", "t").budget == Limit(Unit.DAY, 10**6)


def test_a_tenants_money_budget_merges_over_its_tiers_period_by_period() -> None:
    table = TierTable(
        tiers={"t": TierSpec(spend=Spend(day=Decimal(25), month=Decimal(500)))},
        tenants={"acme": TenantSpec(spend=Spend(day=Decimal(100)))},
    )
    spec = table.tenant_spec("acme", "t").spend
    assert spec is not None and (spec.day, spec.month) == (Decimal(100), Decimal(500))
    policy = Limits(table).policy("acme", "t")
    assert policy.spend == ((Period.DAY, 100_000_000), (Period.MONTH, 500_000_000))
