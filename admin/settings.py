"""Settings of `python -m admin` (file + LLMGW_ADMIN__… environment overrides)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr

from llmgw.config import Strict
from llmgw.redisconf import RedisSettings
from llmgw.secret import Secret

ENV_PREFIX = "LLMGW_ADMIN"


class Settings(Strict):
    # The admin API manages every tenant's keys: on loopback unless the operator says otherwise,
    # and never on Envoy's public listener.
    host: str = "127.0.0.1"
    port: int = Field(default=8086, ge=0, le=65535)
    log_level: str = "info"
    # postgresql://user:password@host:port/db: the tenants' tables, and the ledger's it reads.
    database_url: SecretStr
    # Every /admin/v1/ request's `Authorization: Bearer <admin_token>`.
    admin_token: Secret = Field(min_length=32)
    # The tier table (llmgw/tiers.py): a tenant's tier must be one of it; None: the built-ins.
    tiers_file: Path | None = None
    reload_interval_s: float = Field(default=0.5, gt=0)  # how often the tier table is checked
    # A rotated key keeps working this long beside its successor, unless the rotation says.
    rotation_overlap_s: float = Field(default=86_400.0, ge=0)
    # A tenants file (extauthz's schema) imported at start: its tenants and keys that the
    # database lacks are added, its specs replace the database's (the demo tenants of `llmgw up`).
    import_tenants_file: Path | None = None
    # The Redis of the tenants' breakers (the rate limiter's and the ledger's): their state is
    # read from it (admin/breakers.py). None: not served (those routes answer 503).
    redis: RedisSettings | None = None
    redis_timeout_s: float = Field(default=1.0, gt=0)  # a read of breakers, connecting included
    pool_size: int = Field(default=4, ge=1)  # reports take at most all but one (admin/reports.py)
    connect_timeout_s: float = Field(default=30.0, gt=0)  # the database at start-up
    command_timeout_s: float = Field(default=10.0, gt=0)
    grace_seconds: float = Field(default=5.0, ge=0)  # on SIGTERM: requests in flight finish
