"""Redis within a deadline, else this replica's share in process memory; back to Redis by itself.

Down, not busy. A decision waits for Redis's reply until Redis has sent nothing for
`deadline_s` (0.5 s, settings.failover.deadline_ms) while the reply waits: a reply late only
because the replies before it, or this event loop, are busy (a burst of 1,000 decisions on a
machine busy with other work) still counts, as long as Redis keeps answering. 0.5 s is below
Envoy's 2 s timeout (tools/envoyconf.py), so a degraded answer still reaches Envoy; the
admission in extauthz has its own budget (admit_timeout_ms) however long Redis stays busy.

What degrades. Only a timeout or a transport failure (refused, reset, closed): decisions then use
the LocalStore, a warning is logged once, the gauge goes to 1, and a background probe reconnects
every `probe_interval_s`. An error reply (a script error, OOM, WRONGTYPE) is one request's: Redis
is up, the replica stays on it, and that request alone is decided by the LocalStore, exactly as
in degraded mode; its count stays local until the next return from degraded mode replays it.

Replicas. Every `heartbeat_s` each replica adds its ID to a sorted set with Redis's time
(replicas.lua); the members seen within the last SEEN_BEATS heartbeats are the n replicas,
n = max(floor, seen), where the floor (settings.replicas, default 1) is also n before the first
heartbeat. While degraded, the last n is kept.

Local counters start from each check's last Redis answer, ⌈count / n⌉ per bucket, and enforce
⌊L / n⌋ (at least 1). Their clock is this replica's corrected by its offset from Redis's time at
the last reply, so local buckets are Redis's buckets. Before decisions return to Redis, every
count made locally is added to Redis (replay.lua, one round trip; buckets that already left
their window are skipped): nothing admitted while degraded is forgotten.

The bound, per window of one tenant with limit L (in windows.py's measure used(t)), with
ℓ = max(1, ⌊L / n⌋), R what Redis holds for the window and R_i ≤ R what replica i saw of it in its
last answer. A degraded replica i admits at most ℓ − ⌈R_i / n⌉. So:
  * all n replicas lose Redis: at most R + Σ_i (ℓ − R_i / n) ≤ max(L, n) + Σ_i (R − R_i) / n.
    That is L when every replica's last answer was current, and below (2 − 1/n)·L in the worst
    case (one replica served the tenant alone; the one that made the last admission saw all of R);
  * k of n replicas lose Redis while the rest keep it: at most L + k·ℓ, i.e. L·(1 + 1/n) for one;
  * once Redis is back, the replayed counts are in Redis: the window admits nothing more until
    it has room again, so the excess above is never repeated within the window.
n counts the replicas that beat within SEEN_BEATS heartbeats of the last beat seen; one started
during the outage is not in it and adds up to ℓ of its own. A decision whose Redis reply came too
late may be counted in Redis as well as locally: the strict side.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Sequence
from typing import TypeVar

from llmgw.cluster import connect
from llmgw.resp import Arg, Reply, RespError
from ratelimit import metrics
from ratelimit.redis_store import RedisStore, admit_args, outcome
from ratelimit.store import LocalStore
from ratelimit.types import Check, Grant, StoreResult, granted

log = logging.getLogger(__name__)
T = TypeVar("T")

TRANSPORT = (TimeoutError, ConnectionError, OSError)  # Redis down or unreachable
SEEN_BEATS = 5
QUIET_S = 10.0  # error replies: at most one warning this often


class Failover:
    def __init__(
        self,
        host: str,
        port: int,
        replicas: int = 1,
        deadline_s: float = 0.5,
        probe_interval_s: float = 0.5,
        connect_timeout_s: float = 0.5,
        password: str | None = None,
        heartbeat_s: float = 1.0,
        cluster: bool = False,
    ) -> None:
        self.host = host
        self.port = port
        self.cluster = cluster  # host:port is one node of a Redis Cluster (llmgw/cluster.py)
        self.floor = replicas
        self.local = LocalStore(replicas)
        self.deadline_s = deadline_s
        self.probe_interval_s = probe_interval_s
        self.connect_timeout_s = connect_timeout_s
        self.heartbeat_s = heartbeat_s
        self.id = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self._password = password
        self.redis: RedisStore | None = None
        self._offset_ms = 0  # this replica's clock minus Redis's, at the last reply
        self._quiet_until = 0.0
        self._probe: asyncio.Task[None] | None = None
        self._beat: asyncio.Task[None] | None = None
        self._closing = False
        self._closers: set[asyncio.Task[None]] = set()
        # The loop start() ran on, which every decision runs on: get_running_loop() costs a
        # getpid() system call per decision on Python 3.11.
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def degraded(self) -> bool:
        return self.redis is None

    @property
    def replicas(self) -> int:
        return self.local.replicas

    async def start(self) -> None:
        """Connect now if Redis answers, else start degraded and keep probing."""
        self._loop = asyncio.get_running_loop()
        try:
            self.redis = await self._connect()
            metrics.DEGRADED.set(0)
        except (*TRANSPORT, RespError) as exc:
            self._degrade(exc)
        self._beat = self._loop.create_task(self._heartbeat())

    async def close(self) -> None:
        self._closing = True
        for task in (self._probe, self._beat):
            if task is not None:
                task.cancel()
        if self.redis is not None:
            await self.redis.client.close()
            self.redis = None

    async def admit(
        self,
        prefix: str,
        checks: Sequence[Check],
        now_ms: int,
        *,
        shadow: bool = False,
        reservation: str = "",
        ttl_ms: int = 0,
        grant: Grant | None = None,
        breaker: str = "",
    ) -> StoreResult:
        redis = self.redis
        if redis is not None:
            try:
                started = time.perf_counter()
                answer = await self._admit(
                    redis,
                    checks,
                    admit_args(prefix, checks, shadow, reservation, ttl_ms, grant, breaker),
                )
                metrics.REDIS_SECONDS.observe(time.perf_counter() - started)
                self._offset_ms = now_ms - answer.now_ms
                if answer.circuit_ms is None:  # a breaker's refusal read no counters
                    charged = granted(checks, grant, answer.cap)
                    self.local.remember(prefix, charged, answer, answer.admitted or shadow)
                return answer
            except RespError as exc:
                self._error_reply(exc)
            except TRANSPORT as exc:
                self._degrade(exc)
        return await self.local.admit(
            prefix,
            checks,
            now_ms - self._offset_ms,
            shadow=shadow,
            reservation=reservation,
            ttl_ms=ttl_ms,
            grant=grant,
        )

    async def _admit(
        self, redis: RedisStore, checks: Sequence[Check], args: list[Arg]
    ) -> StoreResult:
        """The script's reply, else TimeoutError once Redis has been silent for the deadline
        (`_expire`). The reply's future itself fails: one timer per call and no task
        cancellation (asyncio.timeout's bookkeeping cost ~3 % of a decision)."""
        loop = self._loop
        assert loop is not None  # self.redis is set by start() or its probe, on that loop
        reply_future = redis.send_admit(args)
        timer = loop.call_at(loop.time() + self.deadline_s, _expire, self, reply_future, False)
        try:
            reply = await reply_future
        except RespError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
            reply = await self._within(redis, redis.eval_admit(args))  # Redis lost its scripts
        finally:
            timer.cancel()
        return outcome(reply, checks)

    async def _within(self, redis: RedisStore, call: Awaitable[T]) -> T:
        """`call`'s result, else TimeoutError once Redis has been silent for the deadline."""
        task = asyncio.ensure_future(call)
        try:
            while True:
                done, _ = await asyncio.wait((task,), timeout=self.deadline_s)
                if done:
                    return task.result()
                if self._silent(redis):
                    await asyncio.sleep(0.001)  # this loop may not have read what came: it polls
                    if self._silent(redis):
                        raise TimeoutError("redis deadline")
        finally:
            task.cancel()

    def _silent(self, redis: RedisStore) -> bool:
        """Redis has sent nothing for the deadline."""
        assert self._loop is not None
        return self._loop.time() - redis.client.owed_since >= self.deadline_s

    async def get_fleet(self, key: str) -> bytes | None:
        """The fleet-load key from Redis (None when degraded, absent or in error)."""
        redis = self.redis
        if redis is None:
            return None
        try:
            return await self._within(redis, redis.get_fleet(key))
        except RespError as exc:
            self._error_reply(exc)
        except TRANSPORT as exc:
            self._degrade(exc)
        return None

    async def _connect(self) -> RedisStore:
        client = await connect(
            self.host, self.port, self.connect_timeout_s, self._password, cluster=self.cluster
        )
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                await client.call("PING")
                store = RedisStore(client)
                await store.load_scripts()
        except BaseException:
            await client.close()
            raise
        return store

    def _error_reply(self, exc: RespError) -> None:
        now = time.monotonic()
        if now >= self._quiet_until:
            self._quiet_until = now + QUIET_S
            log.warning(
                "redis replied with an error; this decision is made from in-process counters",
                extra={"redis": f"{self.host}:{self.port}", "error": repr(exc)},
            )

    def _degrade(self, exc: BaseException) -> None:
        if self.redis is None and self._probe is not None:
            return
        lost, self.redis = self.redis, None
        if lost is not None:
            closer = asyncio.get_running_loop().create_task(lost.client.close())
            self._closers.add(closer)
            closer.add_done_callback(self._closers.discard)
        metrics.DEGRADED.set(1)
        log.warning(
            "redis unavailable, deciding from in-process counters",
            extra={"redis": f"{self.host}:{self.port}", "error": repr(exc)},
        )
        if not self._closing:
            self._probe = asyncio.get_running_loop().create_task(self._reconnect())

    async def _reconnect(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.probe_interval_s)
            try:
                store = await self._connect()
            except (*TRANSPORT, RespError):
                continue
            try:
                await self._replay(store)
            except (*TRANSPORT, RespError):
                await store.client.close()
                continue
            self.redis = store  # no await since the last replay: nothing counted locally is left
            self._probe = None
            metrics.DEGRADED.set(0)
            log.warning(
                "redis back, deciding from redis", extra={"redis": f"{self.host}:{self.port}"}
            )
            return

    async def _replay(self, store: RedisStore) -> None:
        """Every count made locally, added to Redis; again for any made meanwhile."""
        while made := self.local.take():
            try:
                async with asyncio.timeout(self.connect_timeout_s):
                    await store.replay(made)
            except BaseException:
                self.local.give_back(made)
                raise

    async def _heartbeat(self) -> None:
        seen_ms = int(self.heartbeat_s * SEEN_BEATS * 1000)
        while not self._closing:
            redis = self.redis
            if redis is not None:
                try:
                    seen = await self._within(redis, redis.heartbeat(self.id, seen_ms))
                    self.local.replicas = max(self.floor, seen)
                except RespError as exc:
                    self._error_reply(exc)
                except TRANSPORT as exc:
                    self._degrade(exc)
            await asyncio.sleep(self.heartbeat_s)


def _expire(failover: Failover, reply: asyncio.Future[Reply], confirming: bool) -> None:
    """A reply's deadline: Redis is down when it has sent nothing for `deadline_s` while the
    reply waits, not when the reply is late because the replies before it, or this event loop,
    are busy (a burst of 1,000 decisions on a busy machine). The client drops the late reply
    when it comes (llmgw/resp.py)."""
    redis, loop = failover.redis, failover._loop
    if reply.done() or redis is None or loop is None:
        return
    quiet_until = redis.client.owed_since + failover.deadline_s
    if quiet_until == math.inf:  # not sent yet (a cluster's redirect): not owed yet
        loop.call_later(failover.deadline_s, _expire, failover, reply, False)
    elif loop.time() < quiet_until:  # Redis answers: wait on
        loop.call_at(quiet_until, _expire, failover, reply, False)
    elif not confirming:
        # This loop may have been too busy to read what came: once more, after it polls.
        loop.call_later(0.001, _expire, failover, reply, True)
    else:
        reply.set_exception(TimeoutError("redis deadline"))
