"""Settings of `python -m ratelimit` (env overrides: e.g. LLMGW_RATELIMIT__REDIS__PORT=6380)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from llmgw.config import Strict, load, renamed
from llmgw.redisconf import RedisSettings
from llmgw.serve import ServeSettings
from llmgw.telemetry import MetricsSettings, TracingSettings
from llmgw.tiers import load_tiers

ENV_PREFIX = "LLMGW_RATELIMIT"
# Old names still read (llmgw.config.renamed), and what they are now.
DEPRECATED = {
    "limits_file": "tiers_file",
    "redis.deadline_ms": "failover.deadline_ms",
    "redis.probe_interval_s": "failover.probe_interval_s",
}


class FailoverSettings(Strict):
    """How long a decision waits on Redis (ratelimit/failover.py)."""

    # Longest a decision waits on Redis before it counts as down: far above a reply late only
    # because of a burst, below Envoy's ratelimit timeout (apart) and extauthz's
    # admit_timeout_ms (inside: a borrowing decision waits up to three times).
    deadline_ms: float = Field(default=500.0, gt=0)
    probe_interval_s: float = Field(default=0.5, gt=0)  # reconnect attempts while degraded


class FleetLoadSettings(Strict):
    cache_s: float = Field(default=0.5, ge=0)
    stale_after_s: float = Field(default=3.0, gt=0)


class Settings(Strict):
    serve: ServeSettings = ServeSettings(port=8082)
    tracing: TracingSettings = TracingSettings()
    metrics: MetricsSettings = MetricsSettings()
    log_level: str = "info"
    tiers_file: Path | None = None  # the tier table (llmgw/tiers.py); None: the built-in tiers
    reload_interval_s: float = Field(default=0.5, gt=0)  # how often the tier table is checked
    redis: RedisSettings = RedisSettings()
    failover: FailoverSettings = FailoverSettings()
    fleet: FleetLoadSettings = FleetLoadSettings()
    # The least number of replicas degraded mode assumes (limit / replicas each); the count
    # itself comes from the replicas' heartbeat in Redis (ratelimit/failover.py).
    replicas: int = Field(default=1, ge=1)
    # A reservation waits this long for the ledger to settle it; past it the request is settled
    # as if it had none (its reservation stays charged): keep it above the longest stream.
    reservation_ttl_s: float = Field(default=3600.0, gt=0)
    near_limit_ratio: float = Field(default=0.1, ge=0, le=1)

    @model_validator(mode="before")
    @classmethod
    def _deprecated(cls, data: object) -> object:
        return renamed(data, DEPRECATED, "ratelimit ")


def check(path: Path | None) -> Settings:
    """The settings (file + environment) and the tier table they name, both validated."""
    loaded = load(Settings, path, ENV_PREFIX)
    load_tiers(loaded.tiers_file)
    return loaded
