"""Fixtures of the rate-limit tests: a real redis-server, stores, a simulated clock."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from rl_redis import start_redis

from llmgw.resp import Resp
from ratelimit.failover import Failover
from tools.procs import Process


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[Process]:
    """A redis-server of this test's own, for tests that kill or restart it."""
    proc = start_redis(tmp_path)
    yield proc
    proc.stop()


@pytest.fixture
async def resp(redis: int) -> AsyncIterator[Resp]:
    client = await Resp.connect("127.0.0.1", redis, 2.0)
    yield client
    await client.close()


@pytest.fixture
async def make_failover() -> AsyncIterator[Callable[..., Awaitable[Failover]]]:
    """Failover stores (closed at the end): make(port, deadline_s=2.0, replicas=1, password),
    beating every 0.05 s."""
    made: list[Failover] = []

    async def make(
        port: int, deadline_s: float = 2.0, replicas: int = 1, password: str | None = None
    ) -> Failover:
        store = Failover(
            "127.0.0.1",
            port,
            replicas,
            deadline_s=deadline_s,
            probe_interval_s=0.05,
            password=password,
            heartbeat_s=0.05,
        )
        await store.start()
        made.append(store)
        return store

    yield make
    for store in made:
        await store.close()


@pytest.fixture
def clock() -> Clock:
    return Clock()


class Clock:
    """A settable clock in Unix seconds."""

    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
