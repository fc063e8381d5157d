"""Settings: YAML, environment overrides, errors that name the file and the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from ledger.settings import Settings as LedgerSettings
from llmgw import config
from llmgw.stack import StackSettings


def test_env_overrides_nested_values(tmp_path: Path) -> None:
    path = tmp_path / "stack.yaml"
    path.write_text("pods: 3\nenvoy:\n  max_request_bytes: 1000\n")
    env = {"LLMGW_STACK__ENVOY__TIMEOUTS__CONNECT": "2s", "LLMGW_STACK__PODS": "5"}
    settings = config.load(StackSettings, path, "LLMGW_STACK", env)
    assert settings.pods == 5
    assert settings.envoy.max_request_bytes == 1000
    assert settings.envoy.timeouts.connect == "2s"


def test_unknown_key_names_file_and_key(tmp_path: Path) -> None:
    path = tmp_path / "stack.yaml"
    path.write_text("envoy:\n  max_request_byte: 1000\n")
    with pytest.raises(config.ConfigError, match=r"stack.yaml: envoy.max_request_byte"):
        config.load(StackSettings, path, "LLMGW_STACK", {})


def test_bad_value_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "stack.yaml"
    path.write_text("pods: -1\n")
    with pytest.raises(config.ConfigError, match="pods"):
        config.load(StackSettings, path, "LLMGW_STACK", {})


def test_broken_yaml_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "stack.yaml"
    path.write_text("pods: [\n")
    with pytest.raises(config.ConfigError, match=r"stack\.yaml"):
        config.load(StackSettings, path, "LLMGW_STACK", {})


def test_an_old_setting_name_is_read_as_the_new_one_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The tier table's and the Redis waits' older names still load, from a file or the
    environment; both names at once name the conflict."""
    env = {"LLMGW_STACK__RATELIMIT_LIMITS": str(tmp_path)}
    assert config.load(StackSettings, None, "LLMGW_STACK", env).tiers_file == tmp_path
    assert "stack ratelimit_limits: use tiers_file" in caplog.text
    path = tmp_path / "ledger.yaml"
    path.write_text("redis: {host: r, timeout_s: 7}\n")
    ledger = config.load(LedgerSettings, path, "LLMGW_LEDGER", {})
    assert ledger.settle.timeout_s == 7 and ledger.redis.host == "r"
    assert "ledger redis.timeout_s: use settle.timeout_s" in caplog.text
    path.write_text("redis: {timeout_s: 7}\nsettle: {timeout_s: 3}\n")
    with pytest.raises(config.ConfigError, match=r"redis\.timeout_s: the deprecated name of"):
        config.load(LedgerSettings, path, "LLMGW_LEDGER", {})
