"""The fleet-load contract (router → ratelimit): the fleet's utilisation and measured capacity.

The router's publisher (router/publisher.py) writes one `FleetLoad` as JSON to Redis key
`llmgw.wire.FLEET_LOAD_KEY` every `publish_interval` seconds, with a TTL of `publish_ttl`; the
rate limiter (ratelimit/fleet.py) reads it to size the fleet's borrowing pool (ratelimit/pool.py),
and takes a missing, unreadable or stale value for load 1 and no capacity: nothing to borrow.

    {"load": 0.42, "capacity_tpm": 3000000, "capacity_rpm": 6000, "ts": 1767225600.123}
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class FleetLoad(BaseModel):
    # Fields a router of another version adds are ignored (a rolling upgrade runs both).
    model_config = ConfigDict(frozen=True, extra="ignore", allow_inf_nan=False)

    # 0-1: the mean over known pods of max(KV usage, (running + waiting) / capacity), a pod the
    # router would not pick (unhealthy, or its metrics stale) counting as 1.
    load: float
    # Tokens and requests per minute the pickable pods serve at full use, measured from the
    # pods' own counters (router/capacity.py); 0: not known yet.
    capacity_tpm: int = Field(default=0, ge=0)
    capacity_rpm: int = Field(default=0, ge=0)
    ts: float  # Unix seconds when it was measured

    @field_validator("load")
    @classmethod
    def _within_0_1(cls, load: float) -> float:
        return min(max(load, 0.0), 1.0)
