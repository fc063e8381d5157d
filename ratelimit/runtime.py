"""The rate limiter as a part any process can hold: the tier table (its own, hot reloaded, or
the one its holder loads), the Redis store with its failover, the fleet view borrowing reads,
and the limiter that decides.

`python -m ratelimit` serves it behind Envoy's rate-limit filter (ratelimit/service.py); extauthz
holds one to admit inside its own Check, which saves the request path a gRPC exchange
(extauthz/director.py). Either way the ledger settles the reservations from the access log.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from llmgw import wire
from llmgw.config import reveal
from llmgw.reload import Reloading
from llmgw.resp import RespError
from llmgw.settlement import Charge, settle
from llmgw.tiers import TierTable, watched_tiers
from ratelimit.failover import Failover
from ratelimit.fleet import FleetView
from ratelimit.limiter import Limiter
from ratelimit.limits import TableLimits
from ratelimit.pool import Pool
from ratelimit.settings import Settings


class RateLimiter:
    def __init__(self, settings: Settings, tiers: Callable[[], TierTable] | None = None) -> None:
        """`tiers`: the tier table in force in the process that holds this limiter, loaded and
        swapped there (extauthz: the one its tenants are checked against, so a tenant's tier is
        never one this limiter does not know yet); None: `settings.tiers_file`, watched here."""
        self.settings = settings
        self.tiers: Reloading[TierTable] | None = None
        if tiers is None:
            self.tiers = watched_tiers(settings.tiers_file)
            tiers = self.tiers.get
        self.limits = TableLimits(tiers)
        redis, failover = settings.redis, settings.failover
        self.store = store = Failover(
            redis.host,
            redis.port,
            replicas=settings.replicas,
            deadline_s=failover.deadline_ms / 1000,
            probe_interval_s=failover.probe_interval_s,
            connect_timeout_s=redis.connect_timeout_s,
            password=reveal(redis.password),
            cluster=redis.cluster,
        )
        # The fleet signal borrowing reads; extauthz's decision reads its contexts too.
        self.fleet = fleet = FleetView(
            lambda: store.get_fleet(wire.FLEET_LOAD_KEY), time.time, settings.fleet.cache_s
        )
        self.limiter = Limiter(
            self.limits.policy,
            store,
            fleet.snapshot,
            time.time,
            reservation_ttl_s=settings.reservation_ttl_s,
            stale_after_s=settings.fleet.stale_after_s,
            near_limit_ratio=settings.near_limit_ratio,
            pool=Pool(
                lambda: None if store.redis is None else store.redis.client,
                deadline_s=failover.deadline_ms / 1000,
            ),
        )
        self._tasks: list[asyncio.Task[None]] = []  # the fleet view's refresh, the tiers' watch

    async def start(self) -> None:
        """Connect to Redis (degraded until it answers), then keep the fleet view current and
        watch the tier table (if its own)."""
        await self.store.start()
        self._tasks.append(asyncio.create_task(self.fleet.run()))
        if self.tiers is not None:
            self._tasks.append(
                asyncio.create_task(self.tiers.watch(self.settings.reload_interval_s))
            )

    async def release(self, tenant: str, request_id: str) -> bool:
        """Give back the reservation of an admitted request that will never run (its client
        left while it was queued): settled at 0 tokens, once (settle.lua's done key). False:
        Redis unreachable, and the reservation stays charged until it expires."""
        redis = self.store.redis
        if redis is None:
            return False
        done_ttl_ms = int(self.settings.reservation_ttl_s * 1000)
        try:
            async with asyncio.timeout(self.settings.failover.deadline_ms / 1000):
                await settle(redis.client, [Charge(tenant, request_id, 0)], done_ttl_ms)
        except (ConnectionError, TimeoutError, OSError, RespError):
            return False
        return True

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.store.close()
