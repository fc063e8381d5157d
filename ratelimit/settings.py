"""Settings of `python -m ratelimit` (env overrides: e.g. LLMGW_RATELIMIT__REDIS__PORT=6380)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from llmgw.config import Strict, load
from llmgw.secret import Secret
from llmgw.serve import ServeSettings
from llmgw.telemetry import MetricsSettings, TracingSettings
from llmgw.tiers import load_tiers

ENV_PREFIX = "LLMGW_RATELIMIT"


class RedisSettings(Strict):
    host: str = "127.0.0.1"
    port: int = 6379
    password: Secret | None = None  # Redis's requirepass; None: no AUTH
    # host:port is one node of a Redis Cluster; the others are found from it (llmgw/cluster.py).
    # Run the cluster with `cluster-require-full-coverage no`: else while one master is down
    # (until its replica takes over; for good without one) every slot stalls, not just its own.
    cluster: bool = False
    # Longest a decision waits on Redis before it counts as down (ratelimit/failover.py): far
    # above a reply late only because of a burst, below Envoy's ratelimit timeout (apart) and
    # extauthz's admit_timeout_ms (inside: a borrowing decision waits up to three times).
    deadline_ms: float = Field(default=500.0, gt=0)
    probe_interval_s: float = Field(default=0.5, gt=0)  # reconnect attempts while degraded
    connect_timeout_s: float = Field(default=0.5, gt=0)


class FleetSettings(Strict):
    cache_s: float = Field(default=0.5, ge=0)
    stale_after_s: float = Field(default=3.0, gt=0)


class Settings(Strict):
    serve: ServeSettings = ServeSettings(port=8082)
    tracing: TracingSettings = TracingSettings()
    metrics: MetricsSettings = MetricsSettings()
    log_level: str = "info"
    limits_file: Path | None = None  # the tier table (llmgw/tiers.py); None: the built-in tiers
    reload_interval_s: float = Field(default=0.5, gt=0)  # how often the tier table is checked
    redis: RedisSettings = RedisSettings()
    fleet: FleetSettings = FleetSettings()
    # The least number of replicas degraded mode assumes (limit / replicas each); the count
    # itself comes from the replicas' heartbeat in Redis (ratelimit/failover.py).
    replicas: int = Field(default=1, ge=1)
    # A reservation waits this long for the ledger to settle it; past it the request is settled
    # as if it had none (its reservation stays charged): keep it above the longest stream.
    reservation_ttl_s: float = Field(default=3600.0, gt=0)
    near_limit_ratio: float = Field(default=0.1, ge=0, le=1)


def check(path: Path | None) -> Settings:
    """The settings (file + environment) and the tier table they name, both validated."""
    loaded = load(Settings, path, ENV_PREFIX)
    load_tiers(loaded.limits_file)
    return loaded
