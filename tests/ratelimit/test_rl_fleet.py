"""The fleet view: the last fleet load read, and the contexts extauthz reads from it."""

from __future__ import annotations

import asyncio
import time

from llmgw.fleetload import FleetLoad
from ratelimit.fleet import FleetView

PUBLISHED = FleetLoad(load=0.5, ts=1.0, contexts={"m": 1200}).model_dump_json().encode()


async def test_the_view_refreshes_unread() -> None:
    """Nothing reads it (a replica just started, or idle): it is current all the same, so the
    first decision reads the fleet's contexts, not none."""
    fetched = 0

    async def fetch() -> bytes:
        nonlocal fetched
        fetched += 1
        return PUBLISHED

    view = FleetView(fetch, time.monotonic, cache_s=0.0)
    task = asyncio.create_task(view.run())
    try:
        for _ in range(200):
            if fetched >= 2:
                break
            await asyncio.sleep(0.01)
        assert fetched >= 2 and view.current.contexts == {"m": 1200}
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert (view.context("m"), view.context("other")) == (1200, None)
