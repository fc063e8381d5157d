"""`eventually`: the one way a test waits for something to happen.

A bounded wait on a condition: poll it until it holds, and fail once the deadline has passed
without it. The deadline is a bound against a hang, generous on a busy 2-core machine, unless the
test names it as the property it checks (a revoked key refused within the reload interval). The
poll interval is the caller's when polling costs something (a request, a subprocess).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

# What is awaited, for the failure: a text, or a callable giving one at the deadline (the
# metrics page as it was then).
What = str | Callable[[], object]


def _failure(within_s: float, what: What) -> AssertionError:
    text = what() if callable(what) else what
    return AssertionError(f"not within {within_s} s: {text}")


def eventually(
    condition: Callable[[], object], within_s: float, what: What = "", every_s: float = 0.05
) -> float:
    """Poll `condition` every `every_s` until it is true: the seconds that took. An
    AssertionError naming `what` once `within_s` seconds have passed without it."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started >= within_s:
            raise _failure(within_s, what)
        time.sleep(every_s)
    return time.monotonic() - started


async def eventually_async(
    condition: Callable[[], object], within_s: float, what: What = "", every_s: float = 0.05
) -> float:
    """`eventually` inside an event loop: it sleeps with asyncio, so the loop runs meanwhile."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started >= within_s:
            raise _failure(within_s, what)
        await asyncio.sleep(every_s)
    return time.monotonic() - started


async def eventually_awaited(
    condition: Callable[[], Awaitable[object]],
    within_s: float,
    what: What = "",
    every_s: float = 0.05,
) -> float:
    """`eventually_async` for a condition that is itself awaited (a request, a page reloaded)."""
    started = time.monotonic()
    while not await condition():
        if time.monotonic() - started >= within_s:
            raise _failure(within_s, what)
        await asyncio.sleep(every_s)
    return time.monotonic() - started
