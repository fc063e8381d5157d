"""The Redis client and the Lua scripts, against a real redis-server."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable

import pytest

from llmgw.resp import Resp, RespError, encode
from llmgw.tiers import PerUnit, TierSpec, TierTable
from llmgw.wire import tenant_prefix
from ratelimit.failover import Failover
from ratelimit.fleet import IDLE_UNKNOWN
from ratelimit.limiter import Limiter
from ratelimit.limits import Limits
from ratelimit.redis_store import RedisStore
from ratelimit.store import LocalStore, Store
from ratelimit.types import MAX_COUNT, Admission, Check, Unit, Window
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


class _Wire(asyncio.Transport):
    """A transport that records what the client writes."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        pass


async def test_resp_sends_a_turns_first_command_now_the_rest_together_and_reads_any_cut() -> None:
    client = Resp()
    wire = _Wire()
    client.connection_made(wire)
    calls = [client.call("INCR", "n"), client.call("GET", "k"), client.call("EVAL", "x", 0)]
    # The first leaves before the caller goes on (an admission's round trip starts at once)...
    assert wire.writes == [encode(("INCR", "n"))]
    await asyncio.sleep(0)
    # ... the rest of the turn's together at its end, and the next turn starts afresh.
    assert wire.writes[1:] == [encode(("GET", "k")) + encode(("EVAL", "x", 0))]
    calls.append(client.call("PING"))
    assert wire.writes[2:] == [encode(("PING",))]
    replies = b":7\r\n$5\r\nhello\r\n*2\r\n:1\r\n*1\r\n$-1\r\n+PONG\r\n"
    for i in range(len(replies)):  # one byte at a time: every cut point is seen
        client.data_received(replies[i : i + 1])
    assert await asyncio.gather(*calls) == [7, b"hello", [1, [None]], "PONG"]
    assert not client.closed


async def test_resp_a_command_it_cannot_encode_leaves_no_caller_waiting() -> None:
    """Else every later caller would get the reply meant for the one before it."""
    client = Resp()
    wire = _Wire()
    client.connection_made(wire)
    with pytest.raises(UnicodeEncodeError):
        client.call("GET", "\ud800")  # a lone surrogate: no UTF-8 for it
    pending = client.call("GET", "b")
    client.data_received(b"$10\r\nvalue-of-b\r\n")
    assert await asyncio.wait_for(pending, 2) == b"value-of-b"
    assert wire.writes == [encode(("GET", "b"))]


async def test_resp_fails_closed_on_a_reply_nobody_asked_for() -> None:
    client = Resp()
    client.connection_made(_Wire())
    pending = client.call("PING")
    client.data_received(b"+PONG\r\n+EXTRA\r\n")
    assert await pending == "PONG"
    assert client.closed
    with pytest.raises(ConnectionError):
        client.call("PING")


async def test_resp_reads_large_and_long_replies_arriving_in_pieces(resp: Resp) -> None:
    big = b"x" * (3 << 20) + b"\r\n" + b"y" * 1000  # CRLF inside a bulk string is data
    await resp.call("SET", "big", big)
    await resp.call("RPUSH", "long", *range(20_000))
    got_big, got_long = await asyncio.gather(
        resp.call("GET", "big"), resp.call("LRANGE", "long", 0, -1)
    )
    assert got_big == big
    assert got_long == [str(i).encode() for i in range(20_000)]


async def test_resp_sends_what_was_called_before_close(redis: int) -> None:
    client = await Resp.connect("127.0.0.1", redis, 2.0)
    last = client.call("SET", "said-before-close", "yes")  # queued for this turn of the loop
    await client.close()
    with pytest.raises(ConnectionError):
        await last  # its reply is not read: the connection is closed
    check = await Resp.connect("127.0.0.1", redis, 2.0)
    try:
        assert await check.call("GET", "said-before-close") == b"yes"
    finally:
        await check.close()


def test_tenant_prefix_keeps_one_hash_tag() -> None:
    assert tenant_prefix("acme") == "llmgw:rl:{acme}"
    assert tenant_prefix("a}b{c") == "llmgw:rl:{a%7Db%7Bc}"


async def test_redis_and_local_stores_decide_alike(resp: Resp) -> None:
    """A random sequence of admissions in real time: Redis decides at its own clock, the local
    store at the time Redis reported. Small windows, so buckets decay and leave often."""
    rng = random.Random(3)
    redis, local = RedisStore(resp), LocalStore()
    checks = [
        Check("requests:a", Window(500, 50), 4, 1),
        Check("requests:b", Window(2_000, 250), 30, 1),
        Check("budget:c", Window(300, 300, rolling=False), 2_000, 1),
    ]
    decided = set()
    for step in range(200):
        await asyncio.sleep(rng.choice([0, 0, 0.002, 0.01, 0.03, 0.12]))
        estimate = rng.randrange(0, 250)
        these = [*checks, Check("tokens:d", Window(2_000, 250), 1000, estimate, True)]
        there = await redis.admit("p:{t}", these, 0, reservation=f"r{step}", ttl_ms=20_000)
        here = await local.admit("p:{t}", these, there.now_ms)
        assert (there.admitted, there.counts) == (here.admitted, here.counts), step
        decided.add(there.admitted)
    assert decided == {True, False}


async def test_noscript_after_script_flush_is_handled(resp: Resp) -> None:
    store = RedisStore(resp)
    check = [Check("requests:minute", SLIDING[Unit.MINUTE], 10, 1)]
    assert (await store.admit("p:{t}", check, 0)).admitted
    assert await resp.call("SCRIPT", "FLUSH") == "OK"
    outcome = await store.admit("p:{t}", check, 0)
    assert outcome.admitted and outcome.counts == ((1, 0, 0, 0, 0, 0, 0),)


async def test_numbers_far_out_of_range_are_clamped_before_redis(resp: Resp) -> None:
    """A limit or cost of 1e20 (a client's max_tokens) is decided in Redis, not an error."""
    store = RedisStore(resp)
    minute = SLIDING[Unit.MINUTE]
    huge = [Check("tokens:minute", minute, 10**20, 10**20, True)]
    assert not (await store.admit("p:{t}", huge, 0, reservation="r1", ttl_ms=1000)).admitted
    fits = [Check("tokens:minute", minute, 10**20, MAX_COUNT, True)]
    first = await store.admit("p:{t}", fits, 0, reservation="r2", ttl_ms=1000)
    assert first.admitted and first.counts[0][0] == 0
    again = await store.admit("p:{t}", fits, 0)
    assert not again.admitted and again.counts[0][0] == MAX_COUNT
    assert await resp.call("HGET", "p:{t}:res:r2", "n") == str(MAX_COUNT).encode()
    assert Check("x", minute, -5, -1).limit == 0  # and never negative


async def test_skewed_replica_clocks_share_one_window(
    redis: int, make_failover: MakeFailover
) -> None:
    """Two replicas whose clocks are 3 s apart, 50 requests per second, a burst of 200 across
    both: exactly 50, and both report the reset from Redis's time."""
    config = TierTable(tiers={"free": TierSpec(requests=PerUnit(second=50))})
    now = time.time()
    engines = [
        Limiter(Limits(config).policy, await make_failover(redis), lambda: IDLE_UNKNOWN, clock)
        for clock in (lambda: now + 3.0, lambda: now - 3.0)
    ]
    verdicts = await asyncio.gather(
        *(engines[i % 2].admit(Admission("acme", "free")) for i in range(200))
    )
    assert sum(v.allowed for v in verdicts) == 50
    assert all(v.requests is not None and 0 < v.requests.reset_ms <= 1_100 for v in verdicts)


def _limiter(store: Store, config: TierTable, ttl_s: float = 300.0) -> Limiter:
    return Limiter(
        Limits(config).policy, store, lambda: IDLE_UNKNOWN, time.time, reservation_ttl_s=ttl_s
    )


async def test_exact_across_four_replicas(redis: int, make_failover: MakeFailover) -> None:
    """400 concurrent requests through 4 engines sharing one Redis, limit 100 → exactly 100."""
    config = TierTable(tiers={"free": TierSpec(requests=PerUnit(minute=100))})
    engines = [_limiter(await make_failover(redis), config) for _ in range(4)]
    verdicts = await asyncio.gather(
        *(engines[i % 4].admit(Admission("acme", "free")) for i in range(400))
    )
    assert sum(v.allowed for v in verdicts) == 100


async def test_tokens_with_mixed_reservations_never_exceed(
    redis: int, make_failover: MakeFailover
) -> None:
    limit = 10_000
    config = TierTable(tiers={"free": TierSpec(tokens=PerUnit(minute=limit))})
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
