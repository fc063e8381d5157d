"""In-process simulated pods for the simulator's tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

import aiohttp
import pytest

from sim import SimPod, SimSettings

MakePod = Callable[..., Awaitable[SimPod]]

# 100x faster than an H100; metrics still report the H100's (simulated) seconds.
FAST = 0.01


@pytest.fixture
async def make_pod() -> AsyncIterator[MakePod]:
    """`await make_pod(max_num_seqs=4)`: a pod on a free port, closed after the test."""
    async with AsyncExitStack() as stack:

        async def make(**fields: Any) -> SimPod:
            settings = SimSettings(**({"port": 0, "time_scale": FAST} | fields))
            return await stack.enter_async_context(SimPod(settings))

        yield make


@pytest.fixture
async def pod(make_pod: MakePod) -> SimPod:
    return await make_pod()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def drained(pod: SimPod) -> bool:
    """Wait (at most ~2 s) until the engine holds no sequence and no block."""
    for _ in range(200):
        if pod.engine.gauges() == (0, 0, 0.0):
            return True
        await asyncio.sleep(0.01)
    return False


def chat(content: str, **fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}]} | fields
