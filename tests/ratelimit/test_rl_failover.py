"""Redis killed or restarted under load: no errors, bounded decision time, back to Redis."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from rl_redis import redis_port, start_redis

from llmgw.procs import Process
from ratelimit.failover import Failover
from ratelimit.fleet import IDLE_UNKNOWN
from ratelimit.limiter import Limiter
from ratelimit.limits import Limits, LimitsConfig, PerUnit, TierSpec
from ratelimit.types import Admission

MakeFailover = Callable[..., Awaitable[Failover]]
DEADLINE_S = 0.02
MARGIN_S = 0.25  # generous: other test suites share the 2 cores


def limiter(store: Failover) -> Limiter:
    config = LimitsConfig(tiers={"free": TierSpec(requests=PerUnit(minute=100_000))})
    return Limiter(Limits(config).policy, store, lambda: IDLE_UNKNOWN, time.time)


async def test_redis_killed_mid_load_then_restarted(
    own_redis: Process, make_failover: MakeFailover
) -> None:
    port = redis_port(own_redis)
    store = await make_failover(port, deadline_s=DEADLINE_S, replicas=4)
    engine = limiter(store)
    slowest = 0.0

    async def burst(n: int) -> list[bool]:
        nonlocal slowest

        async def one() -> bool:
            nonlocal slowest
            started = time.perf_counter()
            verdict = await engine.admit(Admission("acme", "free"))
            slowest = max(slowest, time.perf_counter() - started)
            return verdict.allowed

        return list(await asyncio.gather(*(one() for _ in range(n))))

    assert all(await burst(50)) and not store.degraded
    load = asyncio.gather(*(burst(20) for _ in range(10)))
    await asyncio.sleep(0)
    own_redis.kill()
    results = await load
    assert all(all(r) for r in results)  # zero errors, all answered
    assert all(await burst(50))
    assert store.degraded
    assert slowest < DEADLINE_S + MARGIN_S

    restarted = start_redis(own_redis.log_path.parent, port)  # same port, empty script cache
    try:
        for _ in range(100):  # bounded wait for the background probe
            if not store.degraded:
                break
            await asyncio.sleep(0.05)
        assert not store.degraded
        assert all(await burst(10))
        assert store.redis is not None
        count = await store.redis.client.call("EVAL", "return #redis.call('KEYS', '*')", 0)
        assert isinstance(count, int) and count > 0  # counted in Redis again
    finally:
        restarted.stop()


async def test_unreachable_at_start_uses_the_local_share(make_failover: MakeFailover) -> None:
    from llmgw.procs import free_port

    store = await make_failover(free_port(), deadline_s=DEADLINE_S, replicas=4)
    config = LimitsConfig(tiers={"free": TierSpec(requests=PerUnit(minute=100))})
    engine = Limiter(Limits(config).policy, store, lambda: IDLE_UNKNOWN, time.time)
    verdicts = [await engine.admit(Admission("acme", "free")) for _ in range(40)]
    assert store.degraded
    assert sum(v.allowed for v in verdicts) == 25  # this replica's share: 100 / 4
    assert verdicts[0].requests is not None and verdicts[0].requests.limit == 25
