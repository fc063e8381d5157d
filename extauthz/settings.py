"""Settings of `python -m extauthz` (file + LLMGW_EXTAUTHZ__… environment overrides)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr

from llmgw.config import Strict
from llmgw.serve import ServeSettings
from llmgw.telemetry import TracingSettings

ENV_PREFIX = "LLMGW_EXTAUTHZ"


class SessionSettings(Strict):
    secret: SecretStr = Field(min_length=32)  # HMAC key; the same on every replica
    previous_secret: SecretStr | None = Field(default=None, min_length=32)  # during rotation
    worker_id: int = Field(default=0, ge=0, le=1023)  # unique per replica
    max_age_seconds: float = Field(default=86_400.0, ge=0)  # 0: sessions never expire


class DecisionSettings(Strict):
    # Keep Envoy's with_request_body.max_request_bytes equal to this (allow_partial_message: true).
    max_body_bytes: int = Field(default=2 * 1024 * 1024, gt=0)
    default_output_tokens: int = Field(default=256, ge=0)  # when the body names no max_tokens
    chars_per_token: float = Field(default=4.0, gt=0)
    max_prefix_blocks: int = Field(default=64, ge=0)  # leading 16-token blocks hashed (router)
    # Bodies from this size on are read in a worker process (extauthz/service.py BodyPool).
    pool_body_bytes: int = Field(default=256 * 1024, ge=1)
    # Each tenant's priority to vLLM's scheduler as x-vllm-priority (llmgw/priority.py). Off:
    # every request gets vLLM's default 0 (first come, first served); a client's own value still
    # never reaches the scheduler.
    engine_priority: bool = True


class Settings(Strict):
    serve: ServeSettings = ServeSettings()
    tracing: TracingSettings = TracingSettings()
    log_level: str = "info"
    tenants_file: Path = Path("tenants.yaml")
    reload_interval_seconds: float = Field(default=0.25, gt=0, le=0.5)
    decision: DecisionSettings = DecisionSettings()
    sessions: SessionSettings
