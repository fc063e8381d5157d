"""A tiny pipelined Redis client (RESP2) on an asyncio protocol.

Why not redis.asyncio: one EVALSHA through it costs ~150 µs of client CPU here, over a raw socket
~22 µs (ENVOY_1.40_FACTS.md). This client matches replies to callers in order (Redis answers one
connection strictly in order), so any number of concurrent callers share one connection without
locks. The first command of a turn of the event loop leaves at once (an admission's round trip
starts before its caller does anything else), the rest of that turn's together at its end; every
reply that arrived is parsed in one pass, so a batch (the ledger's settlements) or concurrent
admissions cost two system calls out and one back, not one per command. A lost connection fails
every pending call with ConnectionError and the client stays closed: the owner reconnects.
With a password, `connect` sends AUTH before anything else and raises AuthError (a RespError)
if Redis refuses it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Protocol, TypeAlias, cast

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

    @property
    def owed_since(self) -> float:
        """Since when (the loop's clock) Redis has owed a reply and sent nothing: the later of
        its last bytes and the sending of the oldest command unanswered; inf when it owes none.
        A command still in this process's buffer (its loop busy) is not owed yet."""
        ...

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


class Resp(asyncio.Protocol):
    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._pending: collections.deque[asyncio.Future[Reply]] = collections.deque()
        self._error: BaseException | None = None
        self._turn = False  # a command left in this turn of the loop: the next ones wait
        self._out: list[bytes] = []  # written at the end of this turn of the loop
        self._parser = _Parser(self._reply)
        # Kept: get_running_loop() costs a getpid system call on Python 3.11, once per command.
        self._loop = asyncio.get_running_loop()
        self._lost: asyncio.Future[None] = self._loop.create_future()
        self._read_at = self._loop.time()
        self._sent: collections.deque[float] = collections.deque()  # per pending; inf: not yet

    @classmethod
    async def connect(
        cls, host: str, port: int, connect_s: float, password: str | None = None
    ) -> Resp:
        """Connect; with a password, AUTH within the same `connect_s` before returning."""
        async with asyncio.timeout(connect_s):
            _, client = await asyncio.get_running_loop().create_connection(cls, host, port)
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

    @property
    def owed_since(self) -> float:
        return max(self._read_at, self._sent[0]) if self._sent else math.inf

    def call(self, *args: Arg) -> asyncio.Future[Reply]:
        """Send one command (now if it is the turn's first, else at the end of this turn of the
        loop); the future resolves with its reply."""
        if self._error is not None:
            raise ConnectionError(f"redis connection closed: {self._error}")
        if len(self._pending) >= MAX_PENDING:
            raise ConnectionError("redis: too many pending commands")
        command = encode(args)  # first: a command that cannot be encoded queues no caller
        future: asyncio.Future[Reply] = self._loop.create_future()
        self._pending.append(future)
        if self._turn:
            self._out.append(command)
            self._sent.append(math.inf)
            return future
        self._turn = True
        self._loop.call_soon(self._flush)
        self._sent.append(self._loop.time())
        if self._transport is not None:
            self._transport.write(command)
        return future

    async def close(self) -> None:
        self._flush()  # what was sent before closing still reaches Redis, as written at once
        self._fail(ConnectionError("closed"))
        if self._transport is not None:
            self._transport.close()
            with contextlib.suppress(OSError):
                await self._lost

    def _flush(self) -> None:
        if self._out and self._error is None and self._transport is not None:
            self._transport.write(b"".join(self._out))
            now, sent = self._loop.time(), self._sent
            for i in range(1, len(self._out) + 1):
                sent[-i] = now
        self._out.clear()
        self._turn = False

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        self._sent.clear()
        while self._pending:
            future = self._pending.popleft()
            if not future.done():
                future.set_exception(ConnectionError(f"redis connection lost: {exc!r}"))

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(exc or ConnectionError("closed by redis"))
        if not self._lost.done():
            self._lost.set_result(None)

    def data_received(self, data: bytes) -> None:
        self._read_at = self._loop.time()
        try:
            self._parser.feed(data)
        except (IndexError, ValueError) as exc:  # not RESP2, or a reply nobody asked for
            self._fail(exc)
            assert self._transport is not None
            self._transport.close()

    def _reply(self, reply: Reply | RespError) -> None:
        future = self._pending.popleft()
        self._sent.popleft()
        if future.done():  # the caller gave up (deadline); the reply is dropped
            return
        if isinstance(reply, RespError):
            future.set_exception(reply)
        else:
            future.set_result(reply)


class _Parser:
    """RESP2 replies from a byte stream cut anywhere, each handed to `deliver` when whole. The
    state (a bulk string's size, the arrays still open) survives between chunks, so every byte
    is read once: a reply of megabytes arriving in pieces costs linear time."""

    def __init__(self, deliver: Callable[[Reply | RespError], None]) -> None:
        self._deliver = deliver
        self._buffer = bytearray()
        self._bulk = -1  # the size of the bulk string awaited; -1: a line is awaited
        self._arrays: list[tuple[list[Reply], int]] = []  # open arrays: items so far, size

    def feed(self, data: bytes) -> None:
        buf = self._buffer
        buf += data
        pos = 0
        try:
            while True:
                value: Reply | RespError
                if self._bulk >= 0:
                    end = pos + self._bulk
                    if len(buf) < end + 2:
                        break
                    value = bytes(memoryview(buf)[pos:end])
                    pos, self._bulk = end + 2, -1
                else:
                    end = buf.find(b"\r\n", pos)
                    if end < 0:
                        break
                    kind, line, start, pos = buf[pos], buf[pos + 1 : end], pos, end + 2
                    if kind == _INT:
                        value = int(line)
                    elif kind == _BULK:
                        self._bulk = int(line)
                        if self._bulk >= 0:
                            continue
                        value = None
                    elif kind == _ARRAY:
                        size = int(line)
                        if size > 0:
                            self._arrays.append(([], size))
                            continue
                        value = None if size < 0 else []
                    elif kind == _SIMPLE:
                        value = line.decode()
                    elif kind == _ERROR:
                        value = RespError(line.decode())
                    else:
                        raise ValueError(
                            f"unexpected RESP reply {bytes(buf[start : start + 32])!r}"
                        )
                self._place(value)
        finally:
            del buf[:pos]

    def _place(self, value: Reply | RespError) -> None:
        while self._arrays:
            if isinstance(value, RespError):
                raise ValueError(f"error inside an array: {value}")
            items, size = self._arrays[-1]
            items.append(value)
            if len(items) < size:
                return
            self._arrays.pop()
            value = items
        self._deliver(value)


_INT, _BULK, _ARRAY, _SIMPLE, _ERROR = b":$*+-"
