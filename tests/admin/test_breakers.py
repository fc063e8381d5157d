"""The tenants' breakers as they stand now (admin/breakers.py), over HTTP, against a real
redis-server: driven by the code that really feeds them (the ledger's ledger/breaker.py, its
outcomes tripping them) and enforces them (ratelimit's admission), read through the API and the
console; without Redis configured, with Redis down or hung."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from admin.console import PREFIX
from ledger.breaker import Breakers
from llmgw.redisconf import RedisSettings
from llmgw.resp import Resp
from llmgw.wire import breaker_key, tenant_prefix
from ratelimit.redis_store import RedisStore
from ratelimit.types import MAX_COUNT, Check, Unit
from ratelimit.windows import SLIDING
from tests.admin.conftest import TIERS, Api, serve
from tests.admin.test_api import assert_error
from tests.admin.test_console import Browser
from tests.eventually import eventually_awaited
from tests.ratelimit.rl_redis import redis_port, start_redis
from tests.ratelimit.test_rl_breaker import outcome

BREAKER = "/admin/v1/tenants/{}/breaker"
OPEN = "/admin/v1/breakers/open"
ANY_CHECK = Check("requests:second", SLIDING[Unit.SECOND], MAX_COUNT, 1)


def at(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)


def near(iso: str | None, expected: datetime) -> bool:
    """The same millisecond (Redis's time in ms, as ISO with microseconds)."""
    return iso is not None and abs(datetime.fromisoformat(iso) - expected) < timedelta(
        milliseconds=1
    )


@pytest.fixture
async def resp(redis: int) -> AsyncIterator[Resp]:
    client = await Resp.connect("127.0.0.1", redis, 2.0)
    yield client
    await client.close()


async def trip(resp: Resp, tenant: str, tier: str) -> int:
    """Two 500s fed as the ledger feeds them: the trip's time (Redis's, ms)."""
    feeder = Breakers(lambda: TIERS, None, None)
    (done,) = await feeder.feed(resp, [outcome(tenant, 500, tier), outcome(tenant, 500, tier)])
    assert done.kind == "trip"
    return done.at_ms


async def snapshot(resp: Resp, tenant: str) -> Any:
    return await resp.call("HGETALL", breaker_key(tenant))


async def test_a_breaker_read_as_it_trips_recovers_and_closes_changing_nothing(
    redis_api: Api, resp: Resp
) -> None:
    await redis_api.tenant("acme", tier="fast")
    path = BREAKER.format("acme")
    closed = {
        "object": "breaker",
        "tenant": "acme",
        "state": "closed",
        "until": None,
        "admits": None,
        "tripped_at": None,
        "cooldown_s": 1.5,  # closed: the cool-down a trip would start with (the tier's)
    }
    assert await redis_api.ok("GET", path) == closed

    # Open: read as it is (a tenant whose cool-down outlasts any pause of a busy machine).
    await redis_api.tenant("slowco", tier="slow")
    tripped_slow = await trip(resp, "slowco", "slow")
    await resp.call("PEXPIRE", breaker_key("slowco"), 50_000)  # an expiry a feed would not set
    before = await snapshot(resp, "slowco")
    opened = await redis_api.ok("GET", BREAKER.format("slowco"))
    assert (opened["state"], opened["admits"], opened["cooldown_s"]) == ("open", None, 600.0)
    assert near(opened["tripped_at"], at(tripped_slow))
    assert near(opened["until"], at(tripped_slow + 600_000))  # the cool-down's end
    assert await snapshot(resp, "slowco") == before  # read, not written
    assert 0 < await resp.call("PTTL", breaker_key("slowco")) <= 50_000  # its expiry not moved

    # Then through recovery, at the fast tier's pace.
    tripped_ms = await trip(resp, "acme", "fast")

    async def state(wanted: str) -> Any:
        got = await redis_api.ok("GET", path)
        return got if got["state"] == wanted else None

    await eventually_awaited(lambda: state("half_open"), 10, "half_open")
    # A request admitted in the step, as ratelimit admits it: the step's count `c` is 1.
    admitted = await RedisStore(resp).admit(
        tenant_prefix("acme"), [ANY_CHECK], 0, breaker=breaker_key("acme")
    )
    before = await snapshot(resp, "acme")
    half = [await redis_api.ok("GET", path) for _ in range(3)]
    assert await snapshot(resp, "acme") == before  # no request counted by reading
    fields = dict(zip(before[::2], before[1::2], strict=True))
    if admitted.circuit_ms is None and b"cs" in fields:  # counted in a step (not after the last)
        assert fields[b"c"] == b"1"
    for h in half:
        if h["state"] != "half_open":
            continue  # the last step ran out meanwhile
        step = {0.1: 1, 0.3: 2, 1.0: 3}[h["admits"]]
        assert near(h["until"], at(tripped_ms + 1500 + step * 1000))  # the step's end
        assert near(h["tripped_at"], at(tripped_ms)) and h["cooldown_s"] == 1.5

    await eventually_awaited(lambda: state("closed"), 10, "closed after the last step")
    assert await redis_api.ok("GET", path) == closed
    # Recovered, not cleaned up yet: the trip is still in the hash (the next feed removes it).
    assert await resp.call("HGET", breaker_key("acme"), "o") is not None


async def test_the_open_breakers_among_a_page_of_tenants(redis_api: Api, resp: Resp) -> None:
    for tenant, tier in (("a", "standard"), ("b", "standard"), ("c", "plain"), ("d", "free")):
        await redis_api.tenant(tenant, tier=tier)
    await trip(resp, "b", "standard")
    await trip(resp, "d", "free")

    first = await redis_api.ok("GET", OPEN, limit=2)
    assert [(s["tenant"], s["state"]) for s in first["data"]] == [("b", "open")]
    assert first["data"][0]["cooldown_s"] == 30.0  # standard's
    assert (first["has_more"], first["last_id"]) == (True, "b")  # the page's last tenant
    second = await redis_api.ok("GET", OPEN, limit=2, after="b")
    assert [(s["tenant"], s["cooldown_s"]) for s in second["data"]] == [("d", 120.0)]
    assert (second["has_more"], second["last_id"]) == (False, "d")
    every = await redis_api.ok("GET", OPEN)
    assert [s["tenant"] for s in every["data"]] == ["b", "d"]
    assert every["data"][0] == await redis_api.ok("GET", BREAKER.format("b"))
    # A tier with no breaker: closed, no cool-down.
    plain = await redis_api.ok("GET", BREAKER.format("c"))
    assert (plain["state"], plain["cooldown_s"]) == ("closed", None)
    assert (await redis_api.call("GET", OPEN, limit=0)).status == 400


async def test_an_unknown_tenants_breaker_is_a_404(redis_api: Api) -> None:
    reply = await redis_api.call("GET", BREAKER.format("nobody"))
    assert reply.status == 404
    assert_error(reply.body, "not_found")
    await redis_api.tenant("gone")
    await redis_api.ok("DELETE", "/admin/v1/tenants/gone")
    assert (await redis_api.call("GET", BREAKER.format("gone"))).status == 404


async def test_without_redis_configured_breaker_state_is_a_503_saying_so(api: Api) -> None:
    await api.tenant("acme")
    for path in (BREAKER.format("acme"), OPEN):
        reply = await api.call("GET", path)
        assert reply.status == 503, reply.body
        assert_error(reply.body, "not_configured")
        assert "no Redis configured" in reply.body["error"]["message"]
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session:
        browser = Browser(api, session)
        await browser.login()
        page = await browser.get(f"{PREFIX}/tenants/acme")
        assert page.status == 200 and "no Redis configured" in page.text


async def test_redis_down_or_hung_is_a_503_and_it_reconnects(db: str, tmp_path: Path) -> None:
    proc = start_redis(tmp_path)
    port = redis_port(proc)
    try:
        async with serve(db, RedisSettings(port=port), TIERS) as api:
            await api.tenant("acme", tier="fast")
            path = BREAKER.format("acme")
            assert (await api.ok("GET", path))["state"] == "closed"

            proc.stop()  # the connection lost, then refused
            for _ in range(2):
                reply = await api.call("GET", path)
                assert reply.status == 503, reply.body
                assert_error(reply.body, "unavailable")
                assert reply.body["error"]["message"].startswith("redis unavailable")
            assert (await api.call("GET", OPEN)).status == 503
            async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as s:
                browser = Browser(api, s)
                await browser.login()
                for page in ("/tenants/acme", "/events"):
                    shown = await browser.get(PREFIX + page)
                    assert shown.status == 200 and "redis unavailable" in shown.text

            proc = proc.fresh().start()  # the same port: read again, connected anew
            assert (await api.ok("GET", path))["state"] == "closed"

            assert proc.pid is not None
            os.kill(proc.pid, signal.SIGSTOP)  # hung: the read's timeout (1 s) answers
            try:
                async with asyncio.timeout(20):  # a bound against a hang, not the timeout
                    reply = await api.call("GET", path)
                assert reply.status == 503, reply.body
                assert reply.body["error"]["message"].startswith("redis unavailable")
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            assert (await api.ok("GET", path))["state"] == "closed"
    finally:
        proc.stop()


async def test_the_console_shows_a_tripped_breaker(redis_api: Api, resp: Resp) -> None:
    await redis_api.tenant("acme")
    await redis_api.tenant("beta")
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session:
        browser = Browser(redis_api, session)
        await browser.login()
        page = (await browser.get(f"{PREFIX}/tenants/acme")).text
        assert 'class="breaker-closed"' in page and "would open it for 30.0 s" in page
        events = (await browser.get(f"{PREFIX}/events")).text
        assert "None." in events.split('id="tripped"')[1].split("</table>")[0]

        tripped_ms = await trip(resp, "acme", "standard")
        until = at(tripped_ms + 30_000).strftime("%Y-%m-%d %H:%M:%S")
        page = (await browser.get(f"{PREFIX}/tenants/acme")).text
        shown = page.split('id="breaker"')[1].split("</p>")[0]
        assert "Open</strong> until " + until in shown
        events = (await browser.get(f"{PREFIX}/events")).text
        rows = events.split('id="tripped"')[1].split("</table>")[0]
        assert ">acme</a>" in rows and ">open<" in rows and until in rows and "beta" not in rows
