"""A Redis with a password (requirepass): the RESP client, the readiness probe and the Failover."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterator

import pytest
from rl_redis import redis_port, start_redis

from llmgw.resp import AuthError, Resp, RespError
from llmgw.tiers import PerUnit, TierSpec, TierTable
from ratelimit.failover import Failover
from ratelimit.fleet import IDLE_UNKNOWN
from ratelimit.limiter import Limiter
from ratelimit.limits import Limits
from ratelimit.types import Admission
from tools.procs import Process, redis_ping

MakeFailover = Callable[..., Awaitable[Failover]]
PASSWORD = secrets.token_urlsafe(24)


@pytest.fixture(scope="module")
def locked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """The port of a redis-server that asks for PASSWORD."""
    proc: Process = start_redis(tmp_path_factory.mktemp("locked"), password=PASSWORD)
    yield redis_port(proc)
    proc.stop()


async def test_resp_authenticates_with_the_password(locked: int) -> None:
    client = await Resp.connect("127.0.0.1", locked, 2.0, PASSWORD)
    try:
        assert await client.call("PING") == "PONG"
    finally:
        await client.close()


async def test_resp_without_the_password_is_refused(locked: int) -> None:
    client = await Resp.connect("127.0.0.1", locked, 2.0)
    try:
        with pytest.raises(RespError, match=r"^NOAUTH"):
            await client.call("PING")
    finally:
        await client.close()


async def test_resp_with_a_wrong_password_fails_clearly_at_connect(locked: int) -> None:
    with pytest.raises(AuthError, match=f"127.0.0.1:{locked} refused AUTH: WRONGPASS") as info:
        await Resp.connect("127.0.0.1", locked, 2.0, "not-" + PASSWORD)
    assert PASSWORD not in str(info.value)


async def test_resp_with_a_password_for_a_redis_without_one_fails_at_connect(redis: int) -> None:
    with pytest.raises(AuthError, match="refused AUTH"):
        await Resp.connect("127.0.0.1", redis, 2.0, PASSWORD)


def test_the_readiness_probe_needs_the_password(locked: int) -> None:
    assert redis_ping("127.0.0.1", locked, PASSWORD)()
    assert not redis_ping("127.0.0.1", locked)()  # NOAUTH is not ready
    assert not redis_ping("127.0.0.1", locked, "not-" + PASSWORD)()


def limiter(store: Failover) -> Limiter:
    config = TierTable(tiers={"free": TierSpec(requests=PerUnit(minute=100_000))})
    return Limiter(Limits(config).policy, store, lambda: IDLE_UNKNOWN, time.time)


async def test_failover_decides_from_redis_with_the_password(
    locked: int, make_failover: MakeFailover
) -> None:
    store = await make_failover(locked, password=PASSWORD)
    assert not store.degraded
    assert (await limiter(store).admit(Admission("auth", "free"))).allowed
    assert not store.degraded


async def test_failover_with_a_wrong_password_stays_degraded_and_admits(
    locked: int, make_failover: MakeFailover, caplog: pytest.LogCaptureFixture
) -> None:
    """A refused AUTH is one more way Redis is unavailable: in-process counters, no error, and
    the warning names the refusal but never the password."""
    caplog.set_level(logging.WARNING, "ratelimit.failover")
    wrong = "not-" + PASSWORD
    store = await make_failover(locked, password=wrong)
    assert store.degraded
    assert (await limiter(store).admit(Admission("auth", "free"))).allowed
    (warning,) = [r for r in caplog.records if r.getMessage().startswith("redis unavailable")]
    assert "WRONGPASS" in warning.__dict__["error"]
    for record in caplog.records:
        assert wrong not in str(record.__dict__)
