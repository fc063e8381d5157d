"""`llmgw spend reset`: the costs settled in a money budget's window are forgiven, the
reservations outstanding stay held and settle as before, the next request is admitted against
what is left, and the soft limits may alert again; `show` reads the same keys."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest_asyncio

from llmgw.resp import Resp
from llmgw.settlement import Charge, settle
from llmgw.wire import tenant_prefix
from ratelimit.redis_store import RedisStore
from ratelimit.types import Check, Period
from ratelimit.windows import period
from tests.ratelimit.rl_redis import redis_port, start_redis
from tools.procs import Process

PREFIX = tenant_prefix("acme")


def money(limit: int, cost: int) -> Check:
    return Check("spend:day", period(Period.DAY), limit, cost, True, True, True)


@pytest_asyncio.fixture
async def redis_server(tmp_path: Path) -> AsyncIterator[Process]:
    proc = start_redis(tmp_path)
    yield proc
    proc.stop()


def llmgw(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmgw", "spend", *args, "--redis-url", url],
        capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )  # fmt: skip


async def test_a_reset_forgives_what_was_settled_and_keeps_what_is_in_flight(
    redis_server: Process,
) -> None:
    port = redis_port(redis_server)
    url = f"redis://127.0.0.1:{port}/0"
    client = await Resp.connect("127.0.0.1", port, 2.0)
    store = RedisStore(client)
    try:
        for rid in ("done", "running"):
            got = await store.admit(
                PREFIX, [money(10_000, 4_000)], 0, reservation=rid, ttl_ms=60_000
            )
            assert got.admitted
        await settle(client, [Charge("acme", "done", 10, cost_micros=3_000)], 60_000)
        assert not (await store.admit(PREFIX, [money(10_000, 4_000)], 0)).admitted  # 7,000 held
        await client.call("SET", f"{PREFIX}:spendalert:day:1:50", 1)  # a claim of another day

        shown = llmgw(url, "show", "--tenant", "acme")
        assert shown.returncode == 0, shown.stderr
        assert "0.007" in shown.stdout and "0.003" in shown.stdout

        done = llmgw(url, "reset", "--tenant", "acme", "--period", "day")
        assert done.returncode == 0, done.stderr
        assert "forgave 0.003" in done.stdout and "0.004 still held" in done.stdout
        # The request in flight still holds its 4,000: 6,000 left, one more of 4,000 fits.
        assert (await store.admit(PREFIX, [money(10_000, 4_000)], 0)).admitted
        assert not (await store.admit(PREFIX, [money(10_000, 4_000)], 0)).admitted
        # It settles as before: its worst case refunded, its cost charged and counted settled.
        [ended] = await settle(client, [Charge("acme", "running", 10, cost_micros=1_000)], 60_000)
        assert [spent for _, _, spent in ended.spent] == [1_000]
        assert await client.call("GET", f"{PREFIX}:spendalert:day:1:50") == b"1"  # untouched
    finally:
        await client.close()


def test_reset_needs_a_period_and_never_prints_the_url(tmp_path: Path) -> None:
    guarded = start_redis(tmp_path, password="the-right-one")
    try:
        url = f"redis://:secret-pw@127.0.0.1:{redis_port(guarded)}/0"
        missing = llmgw(url, "reset", "--tenant", "acme")
        assert missing.returncode == 2 and "--period" in missing.stderr
        refused = llmgw(url, "show", "--tenant", "acme")  # the wrong password: AUTH fails
        assert refused.returncode == 2 and "Redis" in refused.stderr
        assert "secret-pw" not in refused.stderr + refused.stdout
    finally:
        guarded.stop()
