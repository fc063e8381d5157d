"""The router's settings: serving, fleet, pick options and the plugin profile."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple
from urllib.parse import unquote, urlsplit

from pydantic import Field, SecretStr, field_validator

from llmgw.config import ConfigError, Strict, load
from llmgw.serve import ServeSettings
from llmgw.telemetry import TracingSettings
from router.fleet import FleetSettings
from router.plugins.base import PluginError
from router.registry import DEFAULT_PLUGINS, DEFAULT_PROFILE, PluginSpec, ProfileSpec, Registry

ENV_PREFIX = "LLMGW_ROUTER"


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
    # Where the fleet load is published (redis://:PASSWORD@host:port/0); None: not published.
    redis_url: SecretStr | None = None
    # redis_url's host:port is one node of a Redis Cluster; the others are found from it
    # (llmgw/cluster.py). Run the cluster with `cluster-require-full-coverage no`: else while
    # one master is down (until its replica takes over; for good without one) every slot
    # stalls, the fleet key's too.
    redis_cluster: bool = False
    redis_connect_timeout_s: float = Field(default=0.5, gt=0)  # as ratelimit's and the ledger's
    # The endpoint picker protocol of the Gateway API Inference Extension (router/picker.py).
    inference_pool: InferencePoolSettings = InferencePoolSettings()

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, url: SecretStr | None) -> SecretStr | None:
        if url is not None:
            redis_address(url)
        return url


class RedisAddress(NamedTuple):
    host: str
    port: int
    password: str | None


def redis_address(url: SecretStr) -> RedisAddress:
    """host, port and password of a redis:// URL. Only what llmgw's client speaks: no TLS, no
    ACL user (AUTH with a password is the default user), database 0 (the only one a cluster
    has). Errors never quote the URL: it holds the password."""
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
