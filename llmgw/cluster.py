"""A Redis Cluster client with the interface of llmgw.resp.Resp (`call`, `close`, `closed`).

Each command goes to the master of its key's slot (CRC16 of the key or of its {hash tag}, mod
16384), over one pipelined Resp connection per master, so a caller cannot tell one node from a
cluster. The key is the first argument, or for a script (EVAL, EVALSHA, FCALL) the keys after
numkeys, which must share a slot: a script spanning slots fails with CROSSSLOT before it is sent.
A command without a key goes to any master; SCRIPT (LOAD, FLUSH) goes to every master, as each
node has its own script cache (once: it fails if one of them does).

The slot map comes from CLUSTER SLOTS. A MOVED reply updates that slot at once and refreshes the
whole map in the background; ASK sends ASKING and the command to the node named, once. A lost
connection, TRYAGAIN or CLUSTERDOWN (a failover in progress) is retried after a growing pause, on
a freshly loaded map and connection, at most RETRIES times. A command whose connection broke
may already have run, so it can run twice: admit.lua then errs on the strict side and settle.lua
is idempotent by request ID. A caller's deadline (a future it fails itself) stops the retries.
"""

from __future__ import annotations

import asyncio
import binascii
import contextlib
import math
from collections.abc import Coroutine, Sequence
from functools import partial
from typing import Any, TypeAlias

from llmgw.resp import Arg, AuthError, Client, Reply, Resp, RespError

Addr: TypeAlias = tuple[str, int]

SLOTS = 16384
SCRIPTS = frozenset({b"EVAL", b"EVALSHA", b"EVAL_RO", b"EVALSHA_RO", b"FCALL", b"FCALL_RO"})
# Retries pause 20 ms, doubled each time up to 0.5 s: ~3 s in all, enough to ride out a failover
# with a short cluster-node-timeout. Past that (Redis's default timeout is 15 s) the call fails and
# its owner's own recovery takes over (ratelimit's probe, the ledger's next attempt).
RETRIES = 10
BACKOFF_S = 0.02
MAX_BACKOFF_S = 0.5
TRANSIENT = ("MOVED ", "ASK ", "TRYAGAIN", "CLUSTERDOWN")
FAILURES = (ConnectionError, OSError, TimeoutError, RespError)


def key_slot(key: bytes) -> int:
    """The cluster slot of a key: CRC16 (XMODEM) of its first non-empty {hash tag}, or of it."""
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1 : end]
    return binascii.crc_hqx(key, 0) % SLOTS


def command_slot(args: Sequence[Arg]) -> int | None:
    """The one slot a command's keys are in; None for a command without a key."""
    keys = _keys(args)
    slots = {key_slot(k) for k in keys}
    if len(slots) > 1:
        named = ", ".join(f"{k!r} (slot {key_slot(k)})" for k in keys)
        raise RespError(f"CROSSSLOT the keys of one script must share a slot: {named}")
    return slots.pop() if slots else None


class Cluster:
    def __init__(
        self, seeds: Sequence[Addr], connect_s: float, password: str | None = None
    ) -> None:
        self._seeds = list(seeds)
        self._connect_s = connect_s
        self._password = password
        self._slots: list[Addr | None] = [None] * SLOTS
        self._masters: list[Addr] = []
        self._nodes: dict[Addr, Resp] = {}
        self._opening: dict[Addr, asyncio.Task[Resp]] = {}
        self._refreshing: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    @classmethod
    async def connect(
        cls, host: str, port: int, connect_s: float, password: str | None = None
    ) -> Cluster:
        """Load the slot map from the node host:port, then connect (and AUTH) to every master."""
        client = cls([(host, port)], connect_s, password)
        try:
            await client._refresh()
            await asyncio.gather(*(client._node(addr) for addr in client.masters))
        except BaseException:
            await client.close()
            raise
        return client

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def owed_since(self) -> float:
        """The node silent the longest: one node answering must not hide another's silence."""
        return min((node.owed_since for node in self._nodes.values()), default=math.inf)

    @property
    def masters(self) -> list[Addr]:
        return list(self._masters)

    def node_of(self, slot: int) -> Addr | None:
        """The master this client sends the slot's commands to."""
        return self._slots[slot]

    def call(self, *args: Arg) -> asyncio.Future[Reply]:
        """Send one command now (when its master's connection is open); the future resolves with
        its reply, after any redirects and retries."""
        if self._closed:
            raise ConnectionError("redis cluster client closed")
        reply: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        if _raw(args[0]).upper() == b"SCRIPT":
            self._spawn(self._broadcast(reply, args))
            return reply
        try:
            addr = self._route(args)
        except RespError as exc:  # a map refreshed mid-failover may lack the slot: retried
            self._failed(reply, args, 0, exc)
            return reply
        node = self._nodes.get(addr)
        if node is None or node.closed:
            self._spawn(self._prepare(reply, args, 0, None))
        else:
            self._write(reply, args, 0, node, asking=False)
        return reply

    async def close(self) -> None:
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        nodes, self._nodes = list(self._nodes.values()), {}
        for node in nodes:
            await node.close()

    def _route(self, args: Sequence[Arg]) -> Addr:
        slot = command_slot(args)
        addr = self._slots[slot] if slot is not None else self._any()
        if addr is None:
            raise RespError(f"CLUSTERDOWN hash slot {slot} is not served")
        return addr

    def _any(self) -> Addr | None:
        """A master, one with an open connection first."""
        for addr in self._masters:
            node = self._nodes.get(addr)
            if node is not None and not node.closed:
                return addr
        return self._masters[0] if self._masters else None

    def _write(
        self,
        reply: asyncio.Future[Reply],
        args: Sequence[Arg],
        attempt: int,
        node: Resp,
        asking: bool,
    ) -> None:
        try:
            if asking:  # ASKING holds for the next command on this connection only
                node.call("ASKING").add_done_callback(_retrieve)
            answer = node.call(*args)
        except ConnectionError as exc:
            self._failed(reply, args, attempt, exc)
            return
        answer.add_done_callback(partial(self._answered, reply, args, attempt))

    def _answered(
        self,
        reply: asyncio.Future[Reply],
        args: Sequence[Arg],
        attempt: int,
        answer: asyncio.Future[Reply],
    ) -> None:
        exc = answer.exception()
        if reply.done():  # the caller gave up (its deadline)
            return
        if exc is None:
            reply.set_result(answer.result())
        else:
            self._failed(reply, args, attempt, exc)

    def _failed(
        self, reply: asyncio.Future[Reply], args: Sequence[Arg], attempt: int, exc: BaseException
    ) -> None:
        if attempt < RETRIES and not self._closed and _transient(exc):
            self._spawn(self._prepare(reply, args, attempt + 1, exc))
        elif not reply.done():
            reply.set_exception(exc)

    async def _prepare(
        self,
        reply: asyncio.Future[Reply],
        args: Sequence[Arg],
        attempt: int,
        exc: BaseException | None,
    ) -> None:
        """Before a (re)send: follow a redirect, or pause, reload the map; then connect."""
        addr: Addr | None = None
        asking = False
        try:
            if isinstance(exc, RespError) and str(exc).startswith(("MOVED ", "ASK ")):
                kind, slot, target = str(exc).split()[:3]
                host, _, port = target.rpartition(":")
                addr, asking = (host, int(port)), kind == "ASK"
                if kind == "MOVED":
                    self._slots[int(slot)] = addr
                    self._refresh_soon()
            elif exc is not None:
                await asyncio.sleep(min(BACKOFF_S * 2 ** (attempt - 1), MAX_BACKOFF_S))
                await self._refresh()
            node = await self._node(addr or self._route(args))
        except FAILURES as err:
            self._failed(reply, args, attempt, err)
            return
        except asyncio.CancelledError:  # close()
            if not reply.done():
                reply.set_exception(ConnectionError("redis cluster client closed"))
            raise
        if not reply.done():
            self._write(reply, args, attempt, node, asking)

    async def _broadcast(self, reply: asyncio.Future[Reply], args: Sequence[Arg]) -> None:
        """The command on every master; the first master's reply (each gives the same)."""
        try:
            nodes = await asyncio.gather(*(self._node(addr) for addr in self._masters))
            answers = await asyncio.gather(*(node.call(*args) for node in nodes))
        except FAILURES as exc:
            if not reply.done():
                reply.set_exception(exc)
            return
        if not reply.done():
            reply.set_result(answers[0] if answers else None)

    async def _node(self, addr: Addr) -> Resp:
        """An open, authenticated connection to `addr`; one connect at a time per node."""
        node = self._nodes.get(addr)
        if node is not None and not node.closed:
            return node
        opening = self._opening.get(addr)
        if opening is None:
            opening = self._opening[addr] = self._spawn(self._open(addr))
        return await asyncio.shield(opening)

    async def _open(self, addr: Addr) -> Resp:
        lost = self._nodes.pop(addr, None)
        if lost is not None:  # its transport, still open after the connection broke
            await lost.close()
        try:
            node = await Resp.connect(addr[0], addr[1], self._connect_s, self._password)
        finally:
            del self._opening[addr]
        self._nodes[addr] = node
        return node

    def _refresh_soon(self) -> asyncio.Task[None]:
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = self._spawn(self._load_map())
        return self._refreshing

    async def _refresh(self) -> None:
        await asyncio.shield(self._refresh_soon())

    async def _load_map(self) -> None:
        """The slot map from the first node that answers CLUSTER SLOTS."""
        last: BaseException | None = None
        for addr in dict.fromkeys([*self._nodes, *self._masters, *self._seeds]):
            try:
                node = await self._node(addr)
                async with asyncio.timeout(self._connect_s):
                    reply = await node.call("CLUSTER", "SLOTS")
            except AuthError:
                raise
            except FAILURES as exc:
                last = exc
                continue
            self._slots = _slot_map(reply, addr[0])
            # Connections to nodes that are no longer masters stay open until close(): replies
            # to commands they already ran may still be on the way.
            self._masters = sorted({a for a in self._slots if a is not None})
            return
        raise ConnectionError(f"no redis cluster node answered CLUSTER SLOTS: {last!r}")

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_retrieve)
        return task


async def connect(
    host: str, port: int, connect_s: float, password: str | None = None, *, cluster: bool = False
) -> Client:
    """The node host:port (Resp) or, with `cluster`, the Redis Cluster it is a node of."""
    if cluster:
        return await Cluster.connect(host, port, connect_s, password)
    return await Resp.connect(host, port, connect_s, password)


def _raw(arg: Arg) -> bytes:
    return arg if isinstance(arg, bytes) else str(arg).encode()


def _keys(args: Sequence[Arg]) -> list[bytes]:
    if _raw(args[0]).upper() in SCRIPTS:
        try:
            return [_raw(k) for k in args[3 : 3 + int(args[2])]]
        except (IndexError, ValueError):
            return []  # malformed: Redis answers with the error
    return [_raw(args[1])] if len(args) > 1 else []


def _slot_map(reply: Reply, asked: str) -> list[Addr | None]:
    """CLUSTER SLOTS → each slot's master. An empty host means the node that was asked."""
    if not isinstance(reply, list):
        raise RespError(f"CLUSTER SLOTS returned {reply!r}")
    slots: list[Addr | None] = [None] * SLOTS
    for entry in reply:
        if not isinstance(entry, list) or len(entry) < 3:
            raise RespError(f"CLUSTER SLOTS entry {entry!r}")
        start, end, master = entry[0], entry[1], entry[2]
        if not (isinstance(start, int) and isinstance(end, int) and isinstance(master, list)):
            raise RespError(f"CLUSTER SLOTS entry {entry!r}")
        host, port = master[0], master[1]
        if not (isinstance(host, bytes) and isinstance(port, int)):
            raise RespError(f"CLUSTER SLOTS entry {entry!r}")
        addr = (host.decode() or asked, port)
        slots[start : end + 1] = [addr] * (end - start + 1)
    return slots


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, AuthError):
        return False
    if isinstance(exc, RespError):
        return str(exc).startswith(TRANSIENT)
    return isinstance(exc, ConnectionError | OSError | TimeoutError)


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark an exception nobody awaits as seen (else asyncio logs it at garbage collection)."""
    with contextlib.suppress(asyncio.CancelledError):
        future.exception()
