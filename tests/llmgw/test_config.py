"""Settings: YAML, environment overrides, errors that name the file and the key."""

from __future__ import annotations

import logging
import secrets
from pathlib import Path

import pytest

from extauthz.settings import Settings as ExtauthzSettings
from ledger.settings import Settings as LedgerSettings
from llmgw import config
from llmgw.topology import Topology
from tools.stack import StackSettings


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


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize(
    ("env", "topology"),
    [
        ({"RATELIMIT_IN_EXTAUTHZ": "false"}, Topology.RLS),
        ({"ROUTER_IN_EXTAUTHZ": "false"}, Topology.EPP),
        ({"EXTAUTHZ_HTTP": "false"}, Topology.GRPC_CHECK),
        ({"EXTAUTHZ_HTTP": "true", "ROUTER_IN_EXTAUTHZ": "true"}, Topology.GATEWAY),
    ],
)
def test_the_stacks_deprecated_booleans_name_their_topology_and_warn(
    env: dict[str, str], topology: Topology, caplog: pytest.LogCaptureFixture
) -> None:
    """router_in_extauthz, ratelimit_in_extauthz and extauthz_http (each true unless given)
    still set the stack's shape, each one given logged as deprecated."""
    environ = {f"LLMGW_STACK__{k}": v for k, v in env.items()}
    settings = config.load(StackSettings, None, "LLMGW_STACK", environ)
    assert settings.topology is topology
    warned = warnings_of(caplog)
    assert len(warned) == len(env)
    for name in env:
        assert any(f"`{name.lower()}` is deprecated: use `topology`" in w for w in warned), warned


def test_the_deprecated_booleans_refuse_a_shape_without_a_name_or_beside_topology() -> None:
    both_apart = {"LLMGW_STACK__RATELIMIT_IN_EXTAUTHZ": "false"}
    both_apart["LLMGW_STACK__ROUTER_IN_EXTAUTHZ"] = "false"
    with pytest.raises(config.ConfigError, match="no topology has the rate limiter apart"):
        config.load(StackSettings, None, "LLMGW_STACK", both_apart)
    twice = {"LLMGW_STACK__TOPOLOGY": "rls", "LLMGW_STACK__EXTAUTHZ_HTTP": "false"}
    with pytest.raises(config.ConfigError, match="extauthz_http: deprecated, and `topology`"):
        config.load(StackSettings, None, "LLMGW_STACK", twice)


@pytest.mark.parametrize(
    ("env", "topology"),
    [
        ({"PICK": "true", "ADMIT": "true"}, Topology.GATEWAY),
        ({"PICK": "true"}, Topology.RLS),
        ({"ADMIT": "true"}, Topology.EPP),
        ({"PICK": "false", "ADMIT": "false"}, None),
    ],
)
def test_extauthzs_deprecated_pick_and_admit_name_what_it_holds_and_warn(
    env: dict[str, str], topology: Topology | None, caplog: pytest.LogCaptureFixture
) -> None:
    """LLMGW_EXTAUTHZ__PICK and __ADMIT still make extauthz hold the router and the rate
    limiter, each logged as deprecated."""
    environ = {f"LLMGW_EXTAUTHZ__{k}": v for k, v in env.items()}
    environ["LLMGW_EXTAUTHZ__SESSIONS__SECRET"] = secrets.token_hex(32)
    settings = config.load(ExtauthzSettings, None, "LLMGW_EXTAUTHZ", environ)
    assert settings.topology is topology
    held = (env.get("PICK") == "true", env.get("ADMIT") == "true")
    assert (settings.holds_router, settings.holds_limiter) == held
    warned = warnings_of(caplog)
    assert len(warned) == len(env)
    for name in env:
        assert any(f"`{name.lower()}` is deprecated: use `topology`" in w for w in warned), warned


def test_an_old_setting_name_is_read_as_the_new_one_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The tier table's and the Redis waits' older names still load, from a file or the
    environment; both names at once name the conflict."""
    env = {"LLMGW_STACK__RATELIMIT_LIMITS": str(tmp_path)}
    assert config.load(StackSettings, None, "LLMGW_STACK", env).tiers_file == tmp_path
    assert "stack ratelimit_limits is deprecated: use tiers_file" in caplog.text
    path = tmp_path / "ledger.yaml"
    path.write_text("redis: {host: r, timeout_s: 7}\n")
    ledger = config.load(LedgerSettings, path, "LLMGW_LEDGER", {})
    assert ledger.settle.timeout_s == 7 and ledger.redis.host == "r"
    assert "ledger redis.timeout_s is deprecated: use settle.timeout_s" in caplog.text
    path.write_text("redis: {timeout_s: 7}\nsettle: {timeout_s: 3}\n")
    with pytest.raises(config.ConfigError, match=r"redis\.timeout_s: the deprecated name of"):
        config.load(LedgerSettings, path, "LLMGW_LEDGER", {})
