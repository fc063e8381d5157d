"""Flow control's service counts shared by the replicas through a real Redis
(extauthz/fairness.py, extauthz/served.lua)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import pytest

from extauthz.fairness import Served, Sharing
from llmgw import wire
from llmgw.resp import Client, Resp

# No decay worth counting within a test: Redis decays by its own clock, and a busy machine takes
# seconds between two replicas' batches (at 3,600 s, 5 ms already made 1,000 tokens 999.999).
HALF_LIFE_S = 1e9
# Each batch's deadline (the interval is also the Redis call's timeout): a busy machine's.
INTERVAL_S = 10.0
NOW = 100.0


class Replica:
    def __init__(self, client: Callable[[], Client | None]) -> None:
        self.served = Served(HALF_LIFE_S)
        self.sharing = Sharing(self.served, client, INTERVAL_S, clock=lambda: NOW)

    def of(self, tenant: str) -> float:
        return round(self.served.of(tenant, NOW), 3)


@pytest.fixture
async def resp(redis: int) -> AsyncIterator[Resp]:
    client = await Resp.connect("127.0.0.1", redis, 2.0)
    yield client
    await client.close()


async def test_each_replica_orders_by_every_replicas_dispatches(resp: Resp) -> None:
    a, b = Replica(lambda: resp), Replica(lambda: resp)
    a.served.add("flood", 1000, NOW)  # dispatched by replica a only
    b.served.add("light", 10, NOW)
    assert b.of("flood") == 0  # alone, b would put the flood first
    for replica in (a, b, a):
        assert await replica.sharing.share()
    assert (a.of("flood"), a.of("light")) == (1000, 10)
    assert (b.of("flood"), b.of("light")) == (1000, 10)


async def test_a_replica_counts_its_own_between_batches_and_sends_them_once(resp: Resp) -> None:
    a, b = Replica(lambda: resp), Replica(lambda: resp)
    a.served.add("t", 100, NOW)
    assert await a.sharing.share()
    a.served.add("t", 5, NOW)  # after the batch: counted here at once, sent with the next
    assert a.of("t") == 105
    for replica in (a, b):
        assert await replica.sharing.share()
    assert (a.of("t"), b.of("t")) == (105, 105)  # not 205: a batch is sent once


async def test_a_lift_is_shared(resp: Resp) -> None:
    a, b = Replica(lambda: resp), Replica(lambda: resp)
    a.served.lift("newcomer", 500, NOW)  # came back to a band where others wait
    a.served.add("newcomer", 20, NOW)
    assert await a.sharing.share()
    assert await b.sharing.share()
    assert b.of("newcomer") == 520


async def test_a_batch_that_did_not_reach_redis_goes_with_the_next(resp: Resp) -> None:
    reachable = False
    a = Replica(lambda: resp if reachable else None)
    b = Replica(lambda: resp)
    a.served.add("t", 300, NOW)
    assert not await a.sharing.share()
    assert a.of("t") == 300  # its own count, meanwhile
    reachable = True
    a.served.add("t", 7, NOW)
    assert await a.sharing.share()
    assert await b.sharing.share()
    assert b.of("t") == 307


async def test_counts_decay_in_redis_and_vanish_below_a_token(resp: Resp) -> None:
    fast = Served(0.05)  # half-life 50 ms: a 1,000-token count is below one within 0.5 s
    sharing = Sharing(fast, lambda: resp, INTERVAL_S)
    fast.add("t", 1000, time.monotonic())
    assert await sharing.share()
    assert await resp.call("HEXISTS", wire.FLOW_SERVED_KEY, "t") == 1
    for _ in range(100):  # bounded: 100 × 20 ms
        if await resp.call("HEXISTS", wire.FLOW_SERVED_KEY, "t") == 0:
            break
        await sharing.share()
        await asyncio.sleep(0.02)
    assert await resp.call("HEXISTS", wire.FLOW_SERVED_KEY, "t") == 0
    assert fast.of("t", time.monotonic()) == 0
