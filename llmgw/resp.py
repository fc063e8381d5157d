"""A tiny pipelined Redis client (RESP2) on asyncio streams.

Why not redis.asyncio: one EVALSHA through it costs ~150 µs of client CPU here, over a raw socket
~22 µs (ENVOY_1.40_FACTS.md). This client writes each command at once and matches replies to
callers in order (Redis answers one connection strictly in order), so any number of concurrent
callers share one connection without locks. A lost connection fails every pending call with
ConnectionError and the client stays closed: the owner reconnects. With a password, `connect`
sends AUTH before anything else and raises AuthError (a RespError) if Redis refuses it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Sequence
from typing import Protocol, TypeAlias

Reply: TypeAlias = int | bytes | str | list["Reply"] | None
Arg = bytes | str | int

MAX_PENDING = 10_000


class RespError(Exception):
    """An error reply from Redis (e.g. NOSCRIPT, WRONGTYPE)."""


class AuthError(RespError):
    """Redis refused the password (WRONGPASS), or has none configured (ERR ... AUTH)."""


def encode(args: tuple[Arg, ...]) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        raw = arg if isinstance(arg, bytes) else str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(raw), raw))
    return b"".join(parts)


class Client(Protocol):
    """What the services use of Redis: one node (Resp) or a Redis Cluster (llmgw.cluster)."""

    @property
    def closed(self) -> bool: ...

    def call(self, *args: Arg) -> asyncio.Future[Reply]: ...

    async def close(self) -> None: ...


async def evalsha_each(
    client: Client, source: str, sha: str, calls: Sequence[Sequence[Arg]]
) -> list[object]:
    """One EVALSHA of a script per call (numkeys, keys, ARGV), every one written before any
    reply is awaited; the replies in order, errors among them (not raised). Calls answered
    NOSCRIPT (Redis restarted or flushed its scripts) run again after SCRIPT LOAD."""
    replies = await _evalsha(client, sha, calls)
    missing = [i for i, r in enumerate(replies) if _noscript(r)]
    if missing:
        await client.call("SCRIPT", "LOAD", source)
        again = await _evalsha(client, sha, [calls[i] for i in missing])
        for i, reply in zip(missing, again, strict=True):
            replies[i] = reply
    return replies


def _noscript(reply: object) -> bool:
    return isinstance(reply, RespError) and str(reply).startswith("NOSCRIPT")


async def _evalsha(client: Client, sha: str, calls: Sequence[Sequence[Arg]]) -> list[object]:
    futures = [client.call("EVALSHA", sha, *args) for args in calls]
    return list(await asyncio.gather(*futures, return_exceptions=True))


class Resp:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._pending: collections.deque[asyncio.Future[Reply]] = collections.deque()
        self._error: BaseException | None = None
        self._task = asyncio.get_running_loop().create_task(self._read_loop())

    @classmethod
    async def connect(
        cls, host: str, port: int, connect_s: float, password: str | None = None
    ) -> Resp:
        """Connect; with a password, AUTH within the same `connect_s` before returning."""
        async with asyncio.timeout(connect_s):
            reader, writer = await asyncio.open_connection(host, port)
            client = cls(reader, writer)
            if password is None:
                return client
            try:
                await client.call("AUTH", password)
            except RespError as exc:  # Redis's reply never echoes the password
                await client.close()
                raise AuthError(f"redis {host}:{port} refused AUTH: {exc}") from exc
            except BaseException:
                await client.close()
                raise
        return client

    @property
    def closed(self) -> bool:
        return self._error is not None

    def call(self, *args: Arg) -> asyncio.Future[Reply]:
        """Send one command now; the future resolves with its reply."""
        if self._error is not None:
            raise ConnectionError(f"redis connection closed: {self._error}")
        if len(self._pending) >= MAX_PENDING:
            raise ConnectionError("redis: too many pending commands")
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._writer.write(encode(args))
        self._pending.append(future)
        return future

    async def close(self) -> None:
        self._fail(ConnectionError("closed"))
        self._task.cancel()
        self._writer.close()
        with contextlib.suppress(OSError):
            await self._writer.wait_closed()

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        while self._pending:
            future = self._pending.popleft()
            if not future.done():
                future.set_exception(ConnectionError(f"redis connection lost: {exc!r}"))

    async def _read_loop(self) -> None:
        try:
            while True:
                reply = await self._read()
                future = self._pending.popleft()
                if future.done():  # the caller gave up (deadline); the reply is dropped
                    continue
                if isinstance(reply, RespError):
                    future.set_exception(reply)
                else:
                    future.set_result(reply)
        except (OSError, EOFError, asyncio.LimitOverrunError, IndexError, ValueError) as exc:
            self._fail(exc)

    async def _read(self) -> Reply | RespError:
        line = await self._reader.readuntil(b"\r\n")
        kind, body = line[:1], line[1:-2]
        if kind == b":":
            return int(body)
        if kind == b"$":
            size = int(body)
            return None if size < 0 else (await self._reader.readexactly(size + 2))[:-2]
        if kind == b"*":
            size = int(body)
            if size < 0:
                return None
            items: list[Reply] = []
            for _ in range(size):
                item = await self._read()
                if isinstance(item, RespError):
                    raise ValueError(f"error inside an array: {item}")
                items.append(item)
            return items
        if kind == b"+":
            return body.decode()
        if kind == b"-":
            return RespError(body.decode())
        raise ValueError(f"unexpected RESP reply {line[:32]!r}")
