"""Settings of `python -m ledger` (file + LLMGW_LEDGER__… environment overrides)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, HttpUrl, SecretStr, model_validator

from ledger.alerts import AlertKind
from ledger.blame import BlameSettings
from ledger.detectors import Rules
from llmgw.config import Strict, renamed
from llmgw.redisconf import RedisSettings
from llmgw.secret import Secret
from llmgw.serve import ServeSettings
from llmgw.telemetry import MetricsSettings, TracingSettings

ENV_PREFIX = "LLMGW_LEDGER"
# Old names still read (llmgw.config.renamed), and what they are now.
DEPRECATED = {"redis.timeout_s": "settle.timeout_s"}


class SettleSettings(Strict):
    batch_max: int = Field(default=2_000, ge=1)  # outcomes settled in one Redis round trip
    pending_max: int = Field(default=200_000, ge=1)  # unsettled outcomes held while Redis is down
    # How long a settled request ID is remembered, so a batch delivered twice charges once.
    done_ttl_s: float = Field(default=3600.0, gt=0)
    retry_max_s: float = Field(default=2.0, gt=0)
    timeout_s: float = Field(default=2.0, gt=0)  # one batch's settlement round trip


class ReconcileSettings(Strict):
    """Envoy's file access log, reconciled against the database (ledger/reconcile.py)."""

    access_log: Path
    checkpoint: Path | None = None  # None: beside the log, `<access_log>.checkpoint`
    lag_s: float = Field(default=10.0, gt=0)  # the gRPC path's time to deliver a record
    interval_s: float = Field(default=1.0, gt=0)


class WebhookSettings(Strict):
    url: HttpUrl
    secret: Secret | None = Field(default=None, min_length=16)  # HMAC key; None: alerts.secret


class AlertSettings(Strict):
    """Alert hooks (ledger/alerts.py): the rules, and the webhooks of each alert kind."""

    # The HMAC key of every webhook without its own (16 characters at least, like the hooks').
    secret: Secret | None = Field(default=None, min_length=16)
    hooks: dict[AlertKind, list[WebhookSettings]] = Field(default_factory=dict)
    rules: Rules = Rules()
    interval_s: float = Field(default=1.0, gt=0)  # how often the rules are evaluated
    queue_max: int = Field(default=1_000, ge=1)  # deliveries waiting per webhook
    attempts: int = Field(default=6, ge=1)
    backoff_s: float = Field(default=0.5, gt=0)  # before the second attempt; doubling
    backoff_max_s: float = Field(default=30.0, gt=0)
    timeout_s: float = Field(default=5.0, gt=0)  # one attempt, connect to answer

    @model_validator(mode="after")
    def _signed(self) -> AlertSettings:
        for kind, hooks in self.hooks.items():
            for i, hook in enumerate(hooks):
                if hook.secret is None and self.secret is None:
                    raise ValueError(f"hooks.{kind}.{i}: no secret (set it, or alerts.secret)")
        return self


class LedgerMetricsSettings(MetricsSettings):
    # Models with a label of their own (the first a pod served); the rest are `other`.
    model_labels: int = Field(default=64, ge=0)


class Settings(Strict):
    serve: ServeSettings = ServeSettings(port=8084)
    tracing: TracingSettings = TracingSettings()
    metrics: LedgerMetricsSettings = LedgerMetricsSettings()
    log_level: str = "info"
    # postgresql://user:password@host:port/db; None: outcomes are settled and counted, not stored.
    database_url: SecretStr | None = None
    redis: RedisSettings = RedisSettings()
    settle: SettleSettings = SettleSettings()
    backlog_max: int = Field(default=200_000, ge=1)  # records waiting for the database
    # Envoy's file access log, for what the gRPC access log did not deliver; None: not read
    # here (a sidecar beside Envoy does it, `python -m ledger.reconcile`, or nothing does).
    reconcile: ReconcileSettings | None = None
    alerts: AlertSettings = AlertSettings()
    # The tier table (llmgw/tiers.py), for each tier's breaker; None: the built-in tiers.
    tiers_file: Path | None = None
    # When a pod's failures are the pod's, not its tenants' breakers' (ledger/blame.py).
    blame: BlameSettings = BlameSettings()
    reload_interval_s: float = Field(default=0.5, gt=0)  # how often the tier table is checked
    # How often the routers' stream of the pods' batches (llmgw/podbatches.py) is read, for
    # GPU time.
    batches_interval_s: float = Field(default=0.5, gt=0)
    drain_s: float = Field(default=5.0, ge=0)  # on SIGTERM: time to write what is left

    @model_validator(mode="after")
    def _reconciled_into_a_database(self) -> Settings:
        if self.reconcile is not None and self.database_url is None:
            raise ValueError("reconcile: needs database_url (what it reconciles against)")
        return self

    @model_validator(mode="before")
    @classmethod
    def _deprecated(cls, data: object) -> object:
        return renamed(data, DEPRECATED, "ledger ")
