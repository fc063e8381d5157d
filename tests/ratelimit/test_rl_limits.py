"""The limits config: validation, defaults, overrides; the offline config check."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from llmgw.config import ConfigError
from llmgw.tiers import load_tiers
from ratelimit.limits import Limits
from ratelimit.types import Limit, Unit

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
    settings.write_text(f"limits_file: {limits}\nredis: {{deadline_ms: 15}}\n")
    run = [sys.executable, "-m", "ratelimit", "--check-config", str(settings)]
    assert subprocess.run(run, capture_output=True).returncode == 0
    limits.write_text("tiers: {gold: {requests: {minute: -3}}}")
    bad = subprocess.run(run, capture_output=True, text=True)
    assert bad.returncode == 1 and str(limits) in bad.stderr and "minute" in bad.stderr
