"""A cheap load generator: raw asyncio HTTP/1.1 over keep-alive connections (no SDK, no aiohttp).

Each request is built once as bytes; a response is read by its content-length or its chunks.
`closed_loop` keeps `concurrency` requests in flight (one connection each), `paced` sends at a
fixed rate whatever the answers do (open loop), both record per request the status, the time to
the first content event (streams; the whole response otherwise) and the total time.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Target:
    host: str
    port: int
    path: str = "/v1/chat/completions"
    api_key: str = ""

    def request(self, body: dict[str, object]) -> bytes:
        payload = json.dumps(body).encode()
        head = f"POST {self.path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n"
        if self.api_key:
            head += f"authorization: Bearer {self.api_key}\r\n"
        head += f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n"
        return head.encode() + payload


@dataclass
class Samples:
    statuses: dict[int, int] = field(default_factory=dict)
    first: list[float] = field(default_factory=list)  # seconds to the first content event
    total: list[float] = field(default_factory=list)
    elapsed: float = 0.0

    def add(self, status: int, first: float, total: float) -> None:
        self.statuses[status] = self.statuses.get(status, 0) + 1
        self.first.append(first)
        self.total.append(total)

    def extend(self, other: Samples) -> None:
        for status, count in other.statuses.items():
            self.statuses[status] = self.statuses.get(status, 0) + count
        self.first += other.first
        self.total += other.total
        self.elapsed += other.elapsed

    @property
    def count(self) -> int:
        return len(self.total)

    @property
    def errors(self) -> int:
        return self.count - self.statuses.get(200, 0)


@dataclass(frozen=True, slots=True)
class Head:
    """An HTTP/1.1 response's head, as the load generators read it."""

    status: int
    length: int  # -1: none (chunked, or to the connection's close)
    chunked: bool
    keep: bool  # the connection may carry another request
    headers: dict[bytes, bytes]  # lower-case names

    @classmethod
    async def read(cls, reader: asyncio.StreamReader) -> Head:
        raw = await reader.readuntil(b"\r\n\r\n")
        headers: dict[bytes, bytes] = {}
        for line in raw.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name:
                headers[name.strip().lower()] = value.strip()
        length = headers.get(b"content-length")
        return cls(
            int(raw[9:12]),
            int(length) if length is not None else -1,
            b"chunked" in headers.get(b"transfer-encoding", b"").lower(),
            b"close" not in headers.get(b"connection", b"").lower(),
            headers,
        )


class Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, target: Target) -> Conn:
        reader, writer = await asyncio.open_connection(target.host, target.port)
        return cls(reader, writer)

    def close(self) -> None:
        self.writer.close()

    async def exchange(self, request: bytes) -> tuple[int, float, float, bool]:
        """(status, seconds to first content, seconds to the end, connection still usable)."""
        start = time.perf_counter()
        self.writer.write(request)
        head = await Head.read(self.reader)
        status, length, keep = head.status, head.length, head.keep
        first = 0.0
        if head.chunked:
            while True:
                size = int((await self.reader.readline()).split(b";", 1)[0], 16)
                if size == 0:
                    await self.reader.readuntil(b"\r\n")  # no trailers: the empty line
                    break
                data = await self.reader.readexactly(size + 2)
                if not first and b'"content"' in data:
                    first = time.perf_counter() - start
        elif length >= 0:
            await self.reader.readexactly(length)
        else:
            await self.reader.read()
            keep = False
        end = time.perf_counter() - start
        return status, first or end, end, keep


async def open_all(target: Target, n: int) -> list[Conn]:
    return list(await asyncio.gather(*(Conn.open(target) for _ in range(n))))


async def closed_loop(
    target: Target,
    body: dict[str, object] | list[dict[str, object]],
    concurrency: int,
    requests: int | None = None,
    seconds: float | None = None,
    stagger: float = 0.0,
) -> Samples:
    """`requests` in all (or as many as start within `seconds`), `concurrency` at a time.

    With a list of bodies each request takes one at random (seeded); worker i starts
    `i / concurrency * stagger` seconds late, so that equal streams do not arrive in bursts.
    """
    prepared = [target.request(b) for b in (body if isinstance(body, list) else [body])]
    pick = random.Random(len(prepared)).choice
    conns = await open_all(target, concurrency)
    samples = Samples()
    left = requests if requests is not None else 1 << 62
    start = time.perf_counter()
    deadline = start + seconds if seconds is not None else float("inf")

    async def worker(i: int, conn: Conn) -> None:
        nonlocal left
        await asyncio.sleep(i / concurrency * stagger)
        while left > 0 and time.perf_counter() < deadline:
            left -= 1
            status, first, total, keep = await conn.exchange(pick(prepared))
            samples.add(status, first, total)
            if not keep:
                conn.close()
                conn = await Conn.open(target)
        conn.close()

    await asyncio.gather(*(worker(i, c) for i, c in enumerate(conns)))
    samples.elapsed = time.perf_counter() - start
    return samples


async def paced(
    target: Target, body: dict[str, object], rate: float, seconds: float, warm: int = 4
) -> Samples:
    """Open loop: request i starts at i / rate, on an idle connection (a new one if none is)."""
    request = target.request(body)
    idle = await open_all(target, warm)
    samples = Samples()

    async def one() -> None:
        conn = idle.pop() if idle else await Conn.open(target)
        status, first, total, keep = await conn.exchange(request)
        samples.add(status, first, total)
        if keep:
            idle.append(conn)
        else:
            conn.close()

    loop = asyncio.get_running_loop()
    start = loop.time()
    tasks = []
    for i in range(int(rate * seconds)):
        await asyncio.sleep(max(0.0, start + i / rate - loop.time()))
        tasks.append(asyncio.create_task(one()))
    await asyncio.gather(*tasks)
    samples.elapsed = loop.time() - start
    for conn in idle:
        conn.close()
    return samples
