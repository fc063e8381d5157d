"""The scraper and the KV-event subscriber in a process of their own, so that reading the pods
never delays a check on the event loop of the process that picks (extauthz's, fail-closed).

At 256 pods the scrapes alone took most of a core on that loop and its check p99 went to
~160 ms (bench/collectors.py measures both ways). Here the child does the I/O and the parsing —
HTTP, Prometheus text, msgpack events with their token IDs — and sends the parent what the
datastore needs: each pod's scrape as the typed `PodMetrics`, and the KV index's operations with
the block hashes only (router/collectors/channel.py). The parent applies them on its loop in
batches, as the collectors did in process: the datastore (router/fleet.py) stays the one place
the pick reads, the resolver and the outcome feed stay in the parent.

The child is `python -m router.collectors`, reading its stdin: at its end (the parent died,
even by SIGKILL) it exits. A child that dies is started again after `RESTART_SECONDS`; its KV
entries are dropped meanwhile (the new one replays what the pods still buffer), and the pods'
scrapes age out to stale (`stale_after`) until it scrapes again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import Counter
from pydantic import SecretStr

from llmgw import logs
from llmgw.config import reveal
from router import metrics
from router.collectors import channel
from router.collectors.channel import KvOp
from router.collectors.kvevents import KvEventSubscriber
from router.collectors.scraper import Scraper
from router.fleet import Fleet, FleetSettings
from router.kvindex import KvIndex
from router.types import PodId, PodMetrics

log = logging.getLogger(__name__)

RESTART_SECONDS = 1.0
# A child that sends no scrape for this many scrape rounds (and at least this long) while it has
# pods is replaced: stopped, or wedged (a stuck task would otherwise leave every pod stale).
SILENT_ROUNDS = 4
MIN_SILENT_SECONDS = 5.0
FIRST_FRAME_SECONDS = 60.0
WATCH_SECONDS = 0.5
PODS_SECONDS = 0.25  # how often the parent looks for a change of the fleet's pods
FLUSH_SECONDS = 0.005  # what the child collects before sending it (scrapes finish spread out)
COUNT_SECONDS = 1.0  # how often the child's counters are sent
# Hashes the child may hold for a parent that does not read (its loop stalled): past it they are
# replaced by clearing their pods (a lookup may then undercount, never count a block evicted).
MAX_PENDING_HASHES = 1 << 20
# A frame's KV operations: the parent applies a frame at once, then lets the checks run (1M
# hashes held its loop ~1 s; ~16k take ~15 ms; a vLLM step's batch is a handful of blocks).
FRAME_HASHES = 1 << 14


class CollectorProcess:
    """The parent's side: starts the child, keeps it told of the pods, applies what it sends."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        # The child logs as the parent does.
        self.log_level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
        self.proc: asyncio.subprocess.Process | None = None  # the child running now
        self._scraped = False  # a scrape arrived since the watchdog last looked

    async def run(self) -> None:
        while True:
            try:
                await self._child()
            except asyncio.CancelledError:
                raise
            except Exception:  # a broken child is restarted, never the end of the router
                log.exception("the collectors' process failed")
            self.fleet.kv.reset()  # what the child saw is unknown now (the next one replays)
            metrics.KV_BLOCKS.set(0)
            await asyncio.sleep(RESTART_SECONDS)

    async def _child(self) -> None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "router.collectors",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert proc.stdin is not None and proc.stdout is not None
        self.proc = proc
        self._scraped = False
        helpers = [
            asyncio.create_task(self._feed(proc.stdin)),
            asyncio.create_task(self._watch(proc)),
        ]
        try:
            while (payload := await channel.read_frame(proc.stdout)) is not None:
                self.apply(channel.to_parent.decode(payload))
                await asyncio.sleep(0)  # the checks run between frames (each is bounded)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(RESTART_SECONDS):
                    await proc.wait()
            log.error("the collectors' process ended", extra={"returncode": proc.returncode})
        finally:
            for helper in helpers:
                helper.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    async def _watch(self, proc: asyncio.subprocess.Process) -> None:
        """Kills a child that has pods and sends no scrape (it sends every round, failed scrapes
        too) for `SILENT_ROUNDS` rounds at their slowest, `MIN_SILENT_SECONDS` at least, or
        `FIRST_FRAME_SECONDS` for its first (a new process's imports, on a busy machine): it is
        stopped, or wedged. Time this loop itself was stalled counts as one tick, not as the
        child's silence (its frames wait in the pipe meanwhile)."""
        quiet, grace = 0.0, FIRST_FRAME_SECONDS
        s = self.fleet.settings
        silent = max(MIN_SILENT_SECONDS, SILENT_ROUNDS * (s.scrape_interval + 5 * s.scrape_timeout))
        while True:
            before = time.monotonic()
            await asyncio.sleep(WATCH_SECONDS)
            if self._scraped:
                self._scraped, quiet, grace = False, 0.0, 0.0
            elif self.fleet.snapshots:
                quiet += min(time.monotonic() - before, 2 * WATCH_SECONDS)
            else:
                quiet = 0.0
            if quiet > max(silent, grace):
                log.error("the collectors' process went silent: replaced")
                proc.kill()
                return

    async def _feed(self, stdin: asyncio.StreamWriter) -> None:
        stdin.write(channel.frame(channel.Start(_in_clear(self.fleet.settings), self.log_level)))
        sent: set[PodId] | None = None
        while True:
            pods = set(self.fleet.snapshots)
            if pods != sent:
                stdin.write(channel.frame(channel.Pods(sorted(pods))))
                sent = pods
            await stdin.drain()
            await asyncio.sleep(PODS_SECONDS)

    def apply(self, message: channel.ToParent) -> None:
        fleet = self.fleet
        if isinstance(message, channel.Scraped):
            self._scraped = True
            for snap in message.snaps:
                fleet.store(snap)
        elif isinstance(message, channel.KvOps):
            index, pods = fleet.kv, fleet.snapshots
            for op in message.ops:
                if op.pod not in pods:  # gone since (the child learns it later): forgotten
                    index.drop(op.pod)
                elif isinstance(op, channel.Stored):
                    index.stored(op.pod, op.hashes, op.block_size)
                elif isinstance(op, channel.Removed):
                    index.removed(op.pod, op.hashes)
                elif isinstance(op, channel.Cleared):
                    index.cleared(op.pod)
                else:
                    index.drop(op.pod)
            metrics.KV_BLOCKS.set(index.entries())
        else:
            for pod, n in message.scrape_errors.items():
                if pod in fleet.snapshots:  # a label only for the fleet's pods
                    metrics.SCRAPE_ERRORS.labels(pod).inc(n)
            for result, n in message.kv_batches.items():
                metrics.KV_BATCHES.labels(result).inc(n)


class _Recorder(KvIndex):
    """The child's KV index: records the operations for the parent's instead of holding them."""

    def __init__(self, outbox: _Outbox) -> None:
        super().__init__()
        self.outbox = outbox

    def stored(self, pod: PodId, hashes: Iterable[int], block_size: int) -> None:
        self.outbox.kv(channel.Stored(pod, list(hashes), block_size))

    def removed(self, pod: PodId, hashes: Iterable[int]) -> None:
        self.outbox.kv(channel.Removed(pod, list(hashes)))

    def cleared(self, pod: PodId) -> None:
        self.outbox.kv(channel.Cleared(pod))

    def drop(self, pod: PodId) -> None:
        self.outbox.kv(channel.Dropped(pod))


class _Outbox:
    """What the child has to send, flushed `FLUSH_SECONDS` after the first of it: a pod's latest
    scrape only, the KV operations in order (bounded by `MAX_PENDING_HASHES`)."""

    def __init__(self, out: asyncio.StreamWriter) -> None:
        self.out = out
        self.snaps: dict[PodId, PodMetrics] = {}
        self.ops: list[KvOp] = []
        self.hashes = 0
        self.pending = asyncio.Event()

    def scraped(self, snap: PodMetrics) -> None:
        self.snaps[snap.pod] = snap
        self.pending.set()

    def kv(self, op: KvOp) -> None:
        self.ops.append(op)
        self.hashes += _hashes(op)
        if self.hashes > MAX_PENDING_HASHES:
            self.ops = _collapsed(self.ops)
            self.hashes = 0
        self.pending.set()

    async def run(self) -> None:
        while True:
            await self.pending.wait()
            await asyncio.sleep(FLUSH_SECONDS)
            self.pending.clear()
            if self.snaps:
                self.out.write(channel.frame(channel.Scraped(list(self.snaps.values()))))
                self.snaps = {}
            ops, self.ops, self.hashes = self.ops, [], 0
            for frame in _frames(ops):
                self.out.write(channel.frame(channel.KvOps(frame)))
                await self.out.drain()
            await self.out.drain()

    async def count(self) -> None:
        """The child's counters' growth, every `COUNT_SECONDS`."""
        sent: dict[str, dict[str, float]] = {}
        while True:
            await asyncio.sleep(COUNT_SECONDS)
            grown = {
                name: _grown(counter, sent.setdefault(name, {}))
                for name, counter in (
                    ("scrape_errors", metrics.SCRAPE_ERRORS),
                    ("kv_batches", metrics.KV_BATCHES),
                )
            }
            if any(grown.values()):
                self.out.write(channel.frame(channel.Counted(**grown)))
                await self.out.drain()


def _hashes(op: KvOp) -> int:
    return len(op.hashes) if isinstance(op, channel.Stored | channel.Removed) else 0


def _frames(ops: list[KvOp]) -> Iterator[list[KvOp]]:
    """The operations in order, cut where a frame reaches `FRAME_HASHES`."""
    frame: list[KvOp] = []
    hashes = 0
    for op in ops:
        frame.append(op)
        hashes += _hashes(op)
        if hashes >= FRAME_HASHES:
            yield frame
            frame, hashes = [], 0
    if frame:
        yield frame


def _collapsed(ops: list[KvOp]) -> list[KvOp]:
    """Operations too many to hold, replaced by what is safe to believe of their pods: a pod
    dropped among them forgotten, any other known empty (a lookup may then undercount, never
    count a block whose eviction was among them)."""
    dropped = {op.pod for op in ops if isinstance(op, channel.Dropped)}
    pods = dict.fromkeys(op.pod for op in ops)
    return [channel.Dropped(p) if p in dropped else channel.Cleared(p) for p in pods]


def _in_clear(settings: FleetSettings) -> dict[str, Any]:
    """The settings as JSON with their secrets' values (pydantic's JSON masks them)."""
    data = settings.model_dump(mode="json")
    for name in type(settings).model_fields:
        value = getattr(settings, name)
        if isinstance(value, SecretStr):
            data[name] = reveal(value)
    return data


def _grown(counter: Counter, sent: dict[str, float]) -> dict[str, float]:
    """Each label's growth since `sent` (updated), for a counter of one label."""
    out = {}
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                label = next(iter(sample.labels.values()))
                if sample.value > sent.get(label, 0.0):
                    out[label] = sample.value - sent.get(label, 0.0)
                    sent[label] = sample.value
    return out


async def child() -> None:
    """The child's life: read `Start`, scrape and subscribe for the pods it is told, until its
    stdin ends."""
    loop = asyncio.get_running_loop()
    # The channel is a copy of stdout; stdout itself goes to stderr, so that a stray print
    # cannot corrupt a frame.
    out_fd = os.dup(1)
    os.dup2(2, 1)
    reader = asyncio.StreamReader(limit=channel.MAX_FRAME_BYTES)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin.buffer)
    transport, protocol = await loop.connect_write_pipe(
        asyncio.streams.FlowControlMixin, os.fdopen(out_fd, "wb")
    )
    out = asyncio.StreamWriter(transport, protocol, None, loop)

    payload = await channel.read_frame(reader)
    if payload is None:
        return
    start = channel.to_child.decode(payload)
    if not isinstance(start, channel.Start):
        raise ValueError("the collectors' process was not started")
    logs.setup(start.log_level)
    fleet = Fleet(FleetSettings.model_validate(start.fleet))
    outbox = _Outbox(out)
    fleet.listeners.append(lambda pod: outbox.scraped(fleet.snapshots[pod]))
    tasks = [
        asyncio.create_task(Scraper(fleet).run()),
        asyncio.create_task(outbox.run()),
        asyncio.create_task(outbox.count()),
        asyncio.create_task(_told(reader, fleet)),
    ]
    if fleet.settings.kv_events is not None:
        subscriber = KvEventSubscriber(fleet, fleet.settings.kv_events, _Recorder(outbox))
        tasks.append(asyncio.create_task(subscriber.run()))
    # Until stdin ends, or any part fails (the parent then starts another child).
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                log.error("a collector failed", exc_info=task.exception())
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _told(reader: asyncio.StreamReader, fleet: Fleet) -> None:
    """The parent's pods, until stdin ends."""
    while (payload := await channel.read_frame(reader)) is not None:
        message = channel.to_child.decode(payload)
        if isinstance(message, channel.Pods):
            fleet.set_pods(message.pods)
