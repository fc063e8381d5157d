"""The HTTP adapter: Envoy's ext_authz `http_service` check in, the `Answer` out.

A raw asyncio HTTP/1.1 server in the event loop that decides: the check wakes one thread, where
a grpc.aio call passes through gRPC's poller, its completion queue and the loop, each way
(bench/wakeups.py); that plumbing was most of extauthz's CPU per request (bench/cpu.py). The
contract, what Envoy sends and takes from the answer, is llmgw/authzhttp.py.

Only Envoy talks to this port, as its HTTP/1.1 client does: one request at a time on a
connection, the body with a content-length. Anything else is refused and the connection closed;
a check that raises is a 500, which Envoy takes for the service failing (it fails closed).

A check is authenticated, and its body's declared length held in the replica's budget, as soon
as its head has arrived (`receive`): a stranger's check, or one over its tenant's share or the
replica's total, is answered at once and its body never buffered. What a connection buffers
besides is a head, or the start of the next request while one is checked (then it stops
reading): the budget bounds the memory of every body in the process.

Stopping (SIGTERM) drains first, for at least `drain_s` whatever else the process waits for:
every answer tells Envoy to fail the host's health check at once and the health path answers
503, so Envoy takes its checks to other replicas; every answer closes its connection
(`connection: close`: Envoy sends nothing more on it, where a connection closed under it would
reset the check it had just sent). Then the listener closes and what is left with it."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import ssl
import time
from collections.abc import Iterable, Mapping
from typing import Protocol, cast

from extauthz import metrics
from extauthz.answers import Answer
from extauthz.budget import Held
from llmgw import authzhttp, wire

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 128 * 1024  # above Envoy's 60 KiB of request headers, and the request line
# Above any request-body limit Envoy is given (it sends no more; the decision refuses a body
# above its own limit with its OpenAI error): a larger declared length is malformed. What all
# connections buffer together is bounded by the service's body budget.
MAX_BODY_BYTES = 64 * 1024 * 1024
_CRLF2 = b"\r\n\r\n"


def _line(name: str, value: str) -> str:
    return f"{name}: {authzhttp.header_value(value)}\r\n"


def encode(answer: Answer) -> bytes:
    """The answer as an HTTP/1.1 response. Every 5xx is sent as a 429 with the status meant in
    its metadata (wire.META_STATUS): Envoy would take a 5xx for this server failing; a
    local-reply mapper restores it (envoy/envoy.yaml.j2)."""
    status = answer.status
    if status >= 500:
        answer = dataclasses.replace(
            answer, metadata={**answer.metadata, wire.META_STATUS: str(status)}
        )
        status = 429
    parts = [f"HTTP/1.1 {status} {'OK' if status == 200 else 'Denied'}\r\n"]
    seen: set[tuple[str, str]] = set()
    pairs: Iterable[tuple[str, str]] = answer.client_headers
    if answer.allowed:
        # A name both lists carry (the session) is one header, which Envoy puts in both places.
        pairs = (*answer.headers, *answer.client_headers)
        if answer.headers_to_remove:
            parts.append(_line(authzhttp.HEADERS_TO_REMOVE, ",".join(answer.headers_to_remove)))
    for pair in pairs:
        if pair not in seen:
            seen.add(pair)
            parts.append(_line(*pair))
    parts.extend(f"{k}: {v}\r\n" for k, v in authzhttp.metadata_headers(answer.metadata))
    parts.append(f"content-length: {len(answer.body)}\r\n\r\n")
    return "".join(parts).encode("latin-1") + answer.body


_ERROR = b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\n\r\n"


_DRAINING = f"\r\nconnection: close\r\n{authzhttp.IMMEDIATE_FAIL}: true\r\n".encode()
_CLOSE = b"\r\nconnection: close\r\n"


def _health(healthy: bool) -> bytes:
    status = f"{authzhttp.HEALTHY} No Content" if healthy else "503 Unavailable"
    return f"HTTP/1.1 {status}\r\ncontent-length: 0\r\n\r\n".encode()


def _refusal(status: int, reason: str) -> bytes:
    return f"HTTP/1.1 {status} {reason}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".encode()


class _Head:
    """A request's line and headers, parsed once while its body arrives."""

    __slots__ = ("headers", "keep_alive", "length")

    def __init__(self, headers: dict[str, str], length: int, keep_alive: bool) -> None:
        self.headers = headers
        self.length = length
        self.keep_alive = keep_alive


class _Refused(Exception):
    def __init__(self, response: bytes, cause: str) -> None:
        self.response = response
        self.cause = cause


def parse_head(raw: bytes, max_body: int) -> _Head:
    """The request line and headers (`raw` up to, not including, the blank line) as the
    decision reads them: lower-case names, `:method` and `:path`; a repeated name's values
    joined by commas, as Envoy joins them for a gRPC check."""
    try:
        text = raw.decode("latin-1")
        line, *fields = text.split("\r\n")
        method, path, version = line.split(" ")
    except ValueError:
        raise _Refused(_refusal(400, "Bad Request"), "malformed") from None
    if version != "HTTP/1.1":
        raise _Refused(_refusal(505, "HTTP Version Not Supported"), "malformed")
    headers = {":method": method, ":path": path}
    for field in fields:
        name, sep, value = field.partition(":")
        if not sep or not name or name != name.strip():
            raise _Refused(_refusal(400, "Bad Request"), "malformed")
        name = name.lower()
        value = value.strip()
        if name in headers:
            headers[name] = f"{headers[name]},{value}"
        else:
            headers[name] = value
    if "transfer-encoding" in headers:  # Envoy sends a content-length
        raise _Refused(_refusal(501, "Not Implemented"), "malformed")
    declared = headers.get("content-length", "0")
    if not declared.isdigit():
        raise _Refused(_refusal(400, "Bad Request"), "malformed")
    length = int(declared)
    if length > max_body:
        raise _Refused(_refusal(413, "Content Too Large"), "too_large")
    if length and path == authzhttp.HEALTH_PATH:  # answered at its head: nothing to hold a body
        raise _Refused(_refusal(400, "Bad Request"), "malformed")
    return _Head(headers, length, headers.get("connection", "").lower() != "close")


class _Connection(asyncio.Protocol):
    """One connection from Envoy: requests answered in order, one at a time."""

    def __init__(self, server: HttpCheckServer) -> None:
        self.server = server
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.head: _Head | None = None
        self.held: Held | None = None  # the body's bytes, from its head until its check starts
        self.task: asyncio.Task[None] | None = None
        self.paused = False
        self.dropping = 0  # bytes of a turned-away body still to come, read and dropped

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self.transport = None
        if self.held is not None:
            self.held.release()
        if self.task is not None:
            self.task.cancel()  # Envoy gave up on the check (its timeout): nobody waits for it

    def data_received(self, data: bytes) -> None:
        if self.dropping:
            self.dropping -= len(data)
            if self.dropping <= 0 and self.transport is not None:
                self.transport.close()
            return
        self.buffer += data
        if self.task is None:
            self.next_request()
        expected = self.head.length if self.head is not None else 0
        transport = self.transport
        if (
            len(self.buffer) > expected + MAX_HEAD_BYTES
            and transport
            and not transport.is_closing()
        ):
            # More than a head ahead (the next request while one is checked): Envoy never
            # sends it, and what a connection buffers stays bounded.
            transport.pause_reading()
            self.paused = True

    @property
    def idle(self) -> bool:
        return self.task is None and not self.buffer

    def next_request(self) -> None:
        """Start the next complete request in the buffer, if there is one."""
        if self.head is None:
            end = self.buffer.find(_CRLF2)
            if end < 0:
                if len(self.buffer) > MAX_HEAD_BYTES:
                    self.refuse(_Refused(_refusal(431, "Headers Too Large"), "too_large"))
                return
            try:
                head = parse_head(bytes(self.buffer[:end]), self.server.max_body)
            except _Refused as refused:
                self.refuse(refused)
                return
            del self.buffer[: end + 4]
            if head.headers[":path"] == authzhttp.HEALTH_PATH:
                self.write(_health(self.server.healthy), head)
                return
            if head.headers[":path"] == authzhttp.KEY_PATH:
                self.turn_away(encode(self.server.service.key(head.headers)), head)
                return
            received = self.server.service.receive(head.headers, head.length)
            if isinstance(received, Answer):
                self.turn_away(encode(received), head)
                return
            self.head, self.held = head, received
        head = self.head
        if len(self.buffer) < head.length:
            return
        body = bytes(self.buffer[: head.length])
        del self.buffer[: head.length]
        held, self.head, self.held = self.held, None, None
        assert held is not None
        self.task = asyncio.get_running_loop().create_task(self.answer(head, body, held))

    async def answer(self, head: _Head, body: bytes, held: Held) -> None:
        try:
            response = encode(await self.server.service.check(head.headers, body, held=held))
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug costs this check (Envoy fails it closed), never the server
            log.exception("check failed")
            metrics.http_errors("error").inc()
            response = _ERROR
        finally:
            held.release()
        self.task = None
        self.write(response, head)

    def write(self, response: bytes, head: _Head) -> None:
        """Send an answer; close after it when the request asked or the server drains, else
        start the next request already received."""
        transport = self.transport
        if transport is None:
            return
        if self.server.draining:
            transport.write(response.replace(b"\r\n", _DRAINING, 1))
            transport.close()
            return
        transport.write(response)
        if not head.keep_alive:
            transport.close()
            return
        if self.paused:
            self.paused = False
            transport.resume_reading()
        if self.buffer:
            self.next_request()

    def turn_away(self, response: bytes, head: _Head) -> None:
        """Answer a check at its head, its body never buffered: dropped if it is all here
        already (the connection serves on), else the connection closes, its body read and
        dropped until then (closed with bytes unread, it would be reset, and the reset can
        reach Envoy before the answer does)."""
        if len(self.buffer) >= head.length:
            del self.buffer[: head.length]
            self.write(response, head)
            return
        transport = self.transport
        if transport is None:
            return
        transport.write(response.replace(b"\r\n", _DRAINING if self.server.draining else _CLOSE, 1))
        self.dropping = head.length - len(self.buffer)
        self.buffer.clear()

    def refuse(self, refused: _Refused) -> None:
        metrics.http_errors(refused.cause).inc()
        log.warning("refused a malformed check request", extra={"cause": refused.cause})
        if self.transport is not None:
            self.transport.write(refused.response)
            self.transport.close()


class Checks(Protocol):
    """What the server answers with: the director's `key` (whose key a request carries, asked
    at its headers), `receive` at a check's head, `check` with the body."""

    @property
    def healthy(self) -> bool: ...

    def receive(self, headers: Mapping[str, str], length: int) -> Answer | Held: ...

    async def check(self, headers: Mapping[str, str], body: bytes, *, held: Held) -> Answer: ...

    def key(self, headers: Mapping[str, str]) -> Answer: ...


class HttpCheckServer:
    def __init__(
        self, service: Checks, max_body: int = MAX_BODY_BYTES, drain_s: float = 0.0
    ) -> None:
        self.service = service
        self.max_body = max_body
        self.drain_s = drain_s
        self.connections: set[_Connection] = set()
        self.draining = False
        self._drained_at = 0.0
        self._server: asyncio.Server | None = None

    @property
    def healthy(self) -> bool:
        """What the health path answers: not draining, and the service able to check."""
        return not self.draining and self.service.healthy

    async def start(self, host: str, port: int, tls: ssl.SSLContext | None = None) -> int:
        """Listen on host:port (0: a free port), over `tls` if given (llmgw/tls.py); the port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port, ssl=tls)
        port = self._server.sockets[0].getsockname()[1]
        log.info("serving checks over HTTP", extra={"port": port})
        return int(port)

    def drain(self) -> None:
        """Unhealthy to Envoy's health check from now on, and each answer closes its
        connection; checks are still answered."""
        if not self.draining:
            self.draining = True
            self._drained_at = time.monotonic()

    async def stop(self, grace_s: float) -> None:
        """Drain (for `drain_s` since it began), stop listening, answer the checks in flight for
        up to `grace_s`, then close every connection."""
        self.drain()
        await asyncio.sleep(max(0.0, self._drained_at + self.drain_s - time.monotonic()))
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            if conn.idle and conn.transport is not None:
                conn.transport.close()
        pending = [c.task for c in self.connections if c.task is not None]
        if pending:
            await asyncio.wait(pending, timeout=grace_s)
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.abort()
        if self._server is not None:
            await self._server.wait_closed()
