"""The Redis client and the Lua scripts, against a real redis-server."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable

import pytest

from llmgw.resp import Resp, RespError, encode
from llmgw.wire import tenant_prefix
from ratelimit.failover import Failover
from ratelimit.limiter import Limiter
from ratelimit.limits import Limits, LimitsConfig, PerUnit, TierSpec
from ratelimit.redis_store import RedisStore
from ratelimit.store import LocalStore, Store
from ratelimit.types import Admission, Check, Unit
from ratelimit.windows import SLIDING

MakeFailover = Callable[..., Awaitable[Failover]]


def test_encode() -> None:
    assert encode(("GET", b"k", 12)) == b"*3\r\n$3\r\nGET\r\n$1\r\nk\r\n$2\r\n12\r\n"


async def test_resp_pipelines_and_reports_errors(resp: Resp) -> None:
    replies = await asyncio.gather(*(resp.call("INCR", "n") for _ in range(200)))
    assert sorted(replies) == list(range(1, 201))  # type: ignore[type-var]
    assert await resp.call("SET", "s", "v") == "OK"
    assert await resp.call("GET", "s") == b"v"
    assert await resp.call("GET", "missing") is None
    assert await resp.call("EVAL", "return {1, {2, 'x'}}", 0) == [1, [2, b"x"]]
    with pytest.raises(RespError, match="WRONGTYPE"):
        await resp.call("HGETALL", "s")
    assert await resp.call("PING") == "PONG"  # the connection survives an error reply


async def test_resp_fails_pending_calls_when_the_connection_drops(redis: int, resp: Resp) -> None:
    blocked = resp.call("BLPOP", "never", 5)
    killer = await Resp.connect("127.0.0.1", redis, 2.0)
    await killer.call("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
    await killer.close()
    with pytest.raises(ConnectionError):
        await blocked
    assert resp.closed
    with pytest.raises(ConnectionError):
        resp.call("PING")


def test_tenant_prefix_keeps_one_hash_tag() -> None:
    assert tenant_prefix("acme") == "llmgw:rl:{acme}"
    assert tenant_prefix("a}b{c") == "llmgw:rl:{a%7Db%7Bc}"


async def test_redis_and_local_stores_decide_alike(resp: Resp) -> None:
    """A random sequence of admissions, on a simulated clock, in both stores."""
    rng = random.Random(3)
    stores: list[Store] = [RedisStore(resp), LocalStore()]
    checks = [
        Check("requests:second", SLIDING[Unit.SECOND], 4, 1),
        Check("requests:minute", SLIDING[Unit.MINUTE], 30, 1),
    ]
    now = 1_800_000_000_000
    for step in range(300):
        now += rng.choice([0, 7, 50, 130, 900, 4000])
        estimate = rng.randrange(0, 250)
        these = [*checks, Check("tokens:minute", SLIDING[Unit.MINUTE], 1000, estimate, True)]
        rid = f"r{step}"
        outcomes = [
            await s.admit("p:{t}", these, now, reservation=rid, ttl_ms=20_000) for s in stores
        ]
        assert outcomes[0].admitted == outcomes[1].admitted, step
        assert outcomes[0].counts == outcomes[1].counts, step


async def test_noscript_after_script_flush_is_handled(resp: Resp) -> None:
    store = RedisStore(resp)
    check = [Check("requests:minute", SLIDING[Unit.MINUTE], 10, 1)]
    assert (await store.admit("p:{t}", check, 1_800_000_000_000)).admitted
    assert await resp.call("SCRIPT", "FLUSH") == "OK"
    outcome = await store.admit("p:{t}", check, 1_800_000_000_000)
    assert outcome.admitted and outcome.counts == ((1, 0, 0, 0, 0, 0),)


def _limiter(store: Store, config: LimitsConfig, ttl_s: float = 300.0) -> Limiter:
    import time

    from ratelimit.fleet import IDLE_UNKNOWN

    return Limiter(
        Limits(config).policy, store, lambda: IDLE_UNKNOWN, time.time, reservation_ttl_s=ttl_s
    )


async def test_exact_across_four_replicas(redis: int, make_failover: MakeFailover) -> None:
    """400 concurrent requests through 4 engines sharing one Redis, limit 100 → exactly 100."""
    config = LimitsConfig(tiers={"free": TierSpec(requests=PerUnit(minute=100))})
    engines = [_limiter(await make_failover(redis), config) for _ in range(4)]
    verdicts = await asyncio.gather(
        *(engines[i % 4].admit(Admission("acme", "free")) for i in range(400))
    )
    assert sum(v.allowed for v in verdicts) == 100


async def test_tokens_with_mixed_reservations_never_exceed(
    redis: int, make_failover: MakeFailover
) -> None:
    limit = 10_000
    config = LimitsConfig(tiers={"free": TierSpec(tokens=PerUnit(minute=limit))})
    engines = [_limiter(await make_failover(redis), config) for _ in range(4)]
    rng = random.Random(5)
    sizes = [rng.choice([1, 17, 250, 999, 3000]) for _ in range(400)]
    verdicts = await asyncio.gather(
        *(
            engines[i % 4].admit(Admission("acme", "free", request_id=f"r{i}", token_estimate=n))
            for i, n in enumerate(sizes)
        )
    )
    admitted = sum(n for n, v in zip(sizes, verdicts, strict=True) if v.allowed)
    assert admitted <= limit
    assert admitted > limit - 3000  # and the limiter did not stop early
    check = await engines[0].admit(Admission("acme", "free", token_estimate=0))
    assert check.tokens is not None and check.tokens.used == admitted
