"""The router's settings: serving, fleet, pick options and the plugin profile."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr

from llmgw.config import ConfigError, Strict, load
from llmgw.serve import ServeSettings
from llmgw.telemetry import TracingSettings
from router.fleet import FleetSettings
from router.picker import InferencePoolSettings
from router.plugins.base import PluginError
from router.registry import DEFAULT_PLUGINS, DEFAULT_PROFILE, PluginSpec, ProfileSpec, Registry

ENV_PREFIX = "LLMGW_ROUTER"


class Settings(Strict):
    serve: ServeSettings = ServeSettings()
    tracing: TracingSettings = TracingSettings()
    log_level: str = "info"
    fleet: FleetSettings = FleetSettings()
    plugins: list[PluginSpec] = Field(default_factory=lambda: list(DEFAULT_PLUGINS))
    profile: ProfileSpec = DEFAULT_PROFILE
    # Where the fleet load is published (redis://:PASSWORD@host:port/0); None: not published.
    redis_url: SecretStr | None = None
    # The endpoint picker protocol of the Gateway API Inference Extension (router/picker.py).
    inference_pool: InferencePoolSettings = InferencePoolSettings()


def check(path: Path | None, registry: Registry) -> Settings:
    """Load and validate, including building the plugin profile; errors name the file."""
    settings = load(Settings, path, ENV_PREFIX)
    try:
        registry.build(settings.plugins, settings.profile)
    except PluginError as exc:
        raise ConfigError(f"{path if path is not None else ENV_PREFIX}: {exc}") from exc
    return settings
