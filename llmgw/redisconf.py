"""Where a service finds Redis: one settings model for the rate limiter (apart or inside
extauthz) and the ledger. How long each use may wait is the using service's own setting
(ratelimit's `failover`, the ledger's `settle`), not Redis's."""

from __future__ import annotations

from pydantic import Field

from llmgw.config import Strict
from llmgw.secret import Secret


class RedisSettings(Strict):
    host: str = "127.0.0.1"
    port: int = 6379
    password: Secret | None = None  # Redis's requirepass; None: no AUTH
    # host:port is one node of a Redis Cluster; the others are found from it (llmgw/cluster.py).
    # Run the cluster with `cluster-require-full-coverage no`: else while one master is down
    # (until its replica takes over; for good without one) every slot stalls, not just its own.
    cluster: bool = False
    connect_timeout_s: float = Field(default=0.5, gt=0)
