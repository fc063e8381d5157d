"""The router's settings: serving, fleet, pick options and the plugin profile."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple
from urllib.parse import unquote, urlsplit

from pydantic import Field, SecretStr, model_validator

from llmgw.config import ConfigError, Strict, deprecated, load, renamed
from llmgw.redisconf import RedisSettings
from llmgw.serve import ServeSettings
from llmgw.telemetry import TracingSettings
from router.fleet import FleetSettings
from router.plugins.base import PluginError
from router.registry import DEFAULT_PLUGINS, DEFAULT_PROFILE, PluginSpec, ProfileSpec, Registry

ENV_PREFIX = "LLMGW_ROUTER"
# Old names still read (llmgw.config.renamed), and what they are now; `redis_url` too (below).
DEPRECATED = {
    "redis_cluster": "redis.cluster",
    "redis_connect_timeout_s": "redis.connect_timeout_s",
}


class InferencePoolSettings(Strict):
    """`LLMGW_ROUTER__INFERENCE_POOL__ENABLED=true`: speak the picker protocol."""

    enabled: bool = False
    max_body_bytes: int = Field(default=8 * 1024 * 1024, gt=0)  # longer bodies: a 413
    max_prefix_blocks: int = Field(default=64, ge=0)  # leading 16-token blocks hashed


class Settings(Strict):
    serve: ServeSettings = ServeSettings()
    tracing: TracingSettings = TracingSettings()
    log_level: str = "info"
    fleet: FleetSettings = FleetSettings()
    plugins: list[PluginSpec] = Field(default_factory=lambda: list(DEFAULT_PLUGINS))
    profile: ProfileSpec = DEFAULT_PROFILE
    # Where the fleet load is published (llmgw/redisconf.py, as the limiter's and the ledger's);
    # None: not published. Any key under `redis` (LLMGW_ROUTER__REDIS__HOST=…) sets it.
    redis: RedisSettings | None = None
    # The endpoint picker protocol of the Gateway API Inference Extension (router/picker.py).
    inference_pool: InferencePoolSettings = InferencePoolSettings()

    @model_validator(mode="before")
    @classmethod
    def _deprecated(cls, data: object) -> object:
        return renamed(_old_redis(data), DEPRECATED, "router ")


def _old_redis(data: object) -> object:
    """The router's Redis settings of old: `redis_url` read as `redis`'s host, port and
    password; `redis_cluster` and `redis_connect_timeout_s` without a Redis (never read then)
    dropped, so that they do not set one."""
    if not isinstance(data, Mapping):
        return data
    out = dict(data)
    if "redis_url" in out:
        url = out.pop("redis_url")
        if "redis" in out:
            raise ValueError("redis_url: the deprecated form of redis; set only redis")
        if url is not None:
            secret = url if isinstance(url, SecretStr) else SecretStr(str(url))
            host, port, password = redis_address(secret)
            out["redis"] = {"host": host, "port": port, "password": password}
        deprecated("router redis_url", "redis.host, redis.port and redis.password")
    if "redis" not in out:
        for old in DEPRECATED:
            if old in out:
                out.pop(old)
                deprecated(f"router {old}", DEPRECATED[old])
    return out


class RedisAddress(NamedTuple):
    host: str
    port: int
    password: str | None


def redis_address(url: SecretStr) -> RedisAddress:
    """host, port and password of a redis:// URL (the deprecated `redis_url`). Only what
    llmgw's client speaks: no TLS, no ACL user (AUTH with a password is the default user),
    database 0 (the only one a cluster has). Errors never quote the URL: it holds the password."""
    parts = urlsplit(url.get_secret_value())
    if parts.scheme != "redis":
        raise ValueError(f"redis_url: scheme {parts.scheme!r}, only redis:// is supported")
    if parts.username not in (None, "", "default"):
        raise ValueError("redis_url: only the default user (redis://:PASSWORD@host:port)")
    if parts.path not in ("", "/", "/0"):
        raise ValueError("redis_url: only database 0")
    try:
        port = parts.port or 6379
    except ValueError as exc:  # the port is not a number
        raise ValueError("redis_url: the port is not a number") from exc
    if not parts.hostname:
        raise ValueError("redis_url: no host")
    password = unquote(parts.password) if parts.password else None
    return RedisAddress(parts.hostname, port, password)


def check(path: Path | None, registry: Registry) -> Settings:
    """Load and validate, including building the plugin profile; errors name the file."""
    settings = load(Settings, path, ENV_PREFIX)
    try:
        registry.build(settings.plugins, settings.profile)
    except PluginError as exc:
        raise ConfigError(f"{path if path is not None else ENV_PREFIX}: {exc}") from exc
    return settings
