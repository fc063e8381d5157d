"""Config: plugin profiles rejected at load naming the plugin; --check-config on files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from opentelemetry import trace

from llmgw.config import ConfigError, load, reveal
from llmgw.redisconf import RedisSettings
from router.plugins.base import PluginError
from router.registry import PluginSpec, ProfileSpec, WeightedRef, default_registry
from router.runtime import Router
from router.settings import ENV_PREFIX, Settings, check

PICK = PluginSpec(name="pick", type="best-with-exploration")


def build(plugins: list[PluginSpec], scorers: list[str], filters: list[str] | None = None) -> None:
    profile = ProfileSpec(
        filters=filters or [], scorers=[WeightedRef(ref=s) for s in scorers], picker="pick"
    )
    default_registry().build(plugins, profile)


def test_unknown_type_names_the_plugin() -> None:
    with pytest.raises(PluginError, match=r"plugin 'x': unknown type 'nope'"):
        build([PluginSpec(name="x", type="nope"), PICK], ["x"])


def test_duplicate_names_rejected() -> None:
    with pytest.raises(PluginError, match=r"plugin 'kv': duplicate name"):
        build([PluginSpec(name="kv", type="kv-headroom")] * 2 + [PICK], ["kv"])


def test_dangling_reference_rejected() -> None:
    with pytest.raises(PluginError, match=r"undefined plugin 'ghost'"):
        build([PICK], ["ghost"])


def test_wrong_kind_rejected() -> None:
    with pytest.raises(PluginError, match=r"plugin 'pick' is not a scorer"):
        build([PICK], ["pick"])


def test_bad_params_name_the_plugin_and_key() -> None:
    spec = PluginSpec(name="s", type="seed-formula", params={"theta": 2})
    with pytest.raises(PluginError, match=r"plugin 's': theta"):
        build([spec, PICK], ["s"])
    spec = PluginSpec(name="p", type="tenant-priority", params={"low": 8, "high": 3})
    with pytest.raises(PluginError, match=r"plugin 'p': .*low must be below high"):
        build([spec, PICK], ["p"])
    spec = PluginSpec(name="h", type="healthy", params={"x": 1})
    with pytest.raises(PluginError, match=r"plugin 'h': takes no params"):
        build([spec, PICK], [], ["h"])


def test_registering_a_type_twice_fails() -> None:
    from router.plugins import load

    with pytest.raises(PluginError, match="registered twice"):
        default_registry().register(load.TYPE, load.factory)


BAD = {
    "unknown_key.yaml": ("fleet:\n  scrape_every: 1\n", "fleet.scrape_every"),
    "unknown_type.yaml": (
        "plugins:\n  - {name: pick, type: best-with-exploration}\n  - {name: q, type: magic}\n"
        "profile: {filters: [], scorers: [{ref: q}], picker: pick}\n",
        "plugin 'q': unknown type",
    ),
    "dangling.yaml": (
        "plugins:\n  - {name: pick, type: best-with-exploration}\n"
        "profile: {filters: [healthy], scorers: [], picker: pick}\n",
        "undefined plugin 'healthy'",
    ),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_check_config_rejects_bad_files(tmp_path: Path, name: str) -> None:
    text, needle = BAD[name]
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=needle) as err:
        check(path, default_registry())
    assert str(path) in str(err.value)


def test_check_config_cli(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("fleet:\n  pods: ['127.0.0.1:8001']\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD["dangling.yaml"][0])
    ok = subprocess.run(
        [sys.executable, "-m", "router", "--check-config", str(good)],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr
    fail = subprocess.run(
        [sys.executable, "-m", "router", "--check-config", str(bad)], capture_output=True, text=True
    )
    assert fail.returncode == 1
    assert str(bad) in fail.stderr and "healthy" in fail.stderr


PASSWORD = "p@ss:w0rd-9f3c1a7e"  # strong enough for llmgw.secret; %-encoded in a URL: below


def redis_of(env: dict[str, str]) -> RedisSettings | None:
    return load(Settings, None, ENV_PREFIX, env).redis


def test_the_routers_redis_is_the_model_every_service_reads() -> None:
    """llmgw/redisconf.py, as the rate limiter's and the ledger's; none set: not published."""
    assert redis_of({}) is None
    redis = redis_of(
        {
            "LLMGW_ROUTER__REDIS__HOST": "redis",
            "LLMGW_ROUTER__REDIS__PORT": "6380",
            "LLMGW_ROUTER__REDIS__PASSWORD": PASSWORD,
            "LLMGW_ROUTER__REDIS__CLUSTER": "true",
        }
    )
    assert redis is not None and (redis.host, redis.port, redis.cluster) == ("redis", 6380, True)
    assert reveal(redis.password) == PASSWORD


def test_the_old_redis_url_and_switches_still_load_and_warn(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """redis_url, redis_cluster and redis_connect_timeout_s (before the one Redis model) read
    as `redis`'s host, port, password, cluster and connect timeout, each with a warning; the
    URL's password URL-decoded."""
    encoded = "p%40ss%3Aw0rd-9f3c1a7e"
    redis = redis_of(
        {
            "LLMGW_ROUTER__REDIS_URL": f"redis://:{encoded}@redis:6380/0",
            "LLMGW_ROUTER__REDIS_CLUSTER": "true",
            "LLMGW_ROUTER__REDIS_CONNECT_TIMEOUT_S": "0.25",
        }
    )
    assert redis is not None
    assert (redis.host, redis.port, redis.cluster, redis.connect_timeout_s) == (
        "redis",
        6380,
        True,
        0.25,
    )
    assert reveal(redis.password) == PASSWORD
    for old, new in (
        ("redis_url", "redis.host, redis.port and redis.password"),
        ("redis_cluster", "redis.cluster"),
        ("redis_connect_timeout_s", "redis.connect_timeout_s"),
    ):
        assert f"router {old} is deprecated: use {new}" in caplog.text
    assert PASSWORD not in caplog.text and encoded not in caplog.text
    redis = redis_of({"LLMGW_ROUTER__REDIS_URL": "redis://default@10.0.0.7"})
    assert redis is not None and (redis.host, redis.port, redis.password) == (
        "10.0.0.7",
        6379,
        None,
    )
    assert redis_of({"LLMGW_ROUTER__REDIS_URL": "redis://[::1]:7000/"}) is not None


def test_the_old_switches_without_a_redis_publish_nowhere_as_before() -> None:
    """Without redis_url they were never read: they do not make a Redis of the defaults."""
    assert redis_of({"LLMGW_ROUTER__REDIS_CLUSTER": "false"}) is None


def test_the_old_and_the_new_redis_names_at_once_are_refused() -> None:
    both = {"LLMGW_ROUTER__REDIS_URL": "redis://redis", "LLMGW_ROUTER__REDIS__HOST": "redis"}
    with pytest.raises(ConfigError, match="redis_url: the deprecated form of redis"):
        redis_of(both)
    both = {"LLMGW_ROUTER__REDIS__HOST": "r", "LLMGW_ROUTER__REDIS_CLUSTER": "true"}
    both["LLMGW_ROUTER__REDIS__CLUSTER"] = "false"
    with pytest.raises(ConfigError, match=r"redis_cluster: the deprecated name of redis\.cluster"):
        redis_of(both)


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("rediss://:secret@redis:6379/0", "only redis://"),
        ("redis://alice:secret@redis:6379/0", "only the default user"),
        ("redis://:secret@redis:6379/2", "only database 0"),
        ("redis://:secret@redis:port/0", "the port is not a number"),
        ("redis://:secret@:6379/0", "no host"),
    ],
)
def test_an_old_redis_url_the_client_cannot_speak_is_refused_at_load(url: str, reason: str) -> None:
    with pytest.raises(ConfigError, match=f"redis_url: .*{reason}") as raised:
        redis_of({"LLMGW_ROUTER__REDIS_URL": url})
    assert "secret" not in str(raised.value)


def test_the_publisher_connects_to_redis_within_the_connect_timeout() -> None:
    """Not within the publish interval, which it was once given instead."""
    env = {
        "LLMGW_ROUTER__REDIS__HOST": "redis",
        "LLMGW_ROUTER__REDIS__CONNECT_TIMEOUT_S": "0.25",
        "LLMGW_ROUTER__FLEET__PUBLISH_INTERVAL": "3",
    }
    router = Router.from_settings(load(Settings, None, ENV_PREFIX, env), trace.get_tracer("t"))
    assert router.redis is not None and router.redis.connect_timeout_s == 0.25
