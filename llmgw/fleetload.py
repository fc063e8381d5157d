"""The fleet-load contract (router → ratelimit, extauthz): the fleet's utilisation, measured
capacity and the context of each model it serves.

The router's publisher (router/publisher.py) writes one `FleetLoad` as JSON to Redis key
`llmgw.wire.FLEET_LOAD_KEY` every `publish_interval` seconds, with a TTL of `publish_ttl`; the
rate limiter (ratelimit/fleet.py) reads it to size the fleet's borrowing pool (ratelimit/pool.py),
and takes a missing, unreadable or stale value for load 1 and no capacity: nothing to borrow.
extauthz, when the router runs apart, reads the contexts from it (through its rate limiter's
view, ratelimit/fleet.py) to bound the output cap it appends; none known: the cap is unbounded by
them, as before the router had scraped any pod.

    {"load": 0.42, "capacity_tpm": 3000000, "capacity_rpm": 6000, "ts": 1767225600.123,
     "contexts": {"llama-3-8b": 8192}}
"""

from __future__ import annotations

from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator


class ModelContexts(Protocol):
    """The fleet's contexts as a process reads them: the router's datastore in the process that
    holds the router (router/fleet.py), else the last `FleetLoad` read (ratelimit/fleet.py)."""

    def context(self, model: str) -> int | None:
        """The model's context in tokens: the least `max_model_len` of the pods serving it that
        publish one in /v1/models; None: not known (no pod of it scraped yet)."""
        ...


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
    # Per model the fleet serves, its context (`ModelContexts.context`); {}: none known yet.
    contexts: dict[str, PositiveInt] = Field(default_factory=dict)

    @field_validator("load")
    @classmethod
    def _within_0_1(cls, load: float) -> float:
        return min(max(load, 0.0), 1.0)
