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
import logging
import os
import sys
from collections.abc import Iterable

from prometheus_client import Counter

from llmgw import logs
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
PODS_SECONDS = 0.25  # how often the parent looks for a change of the fleet's pods
FLUSH_SECONDS = 0.005  # what the child collects before sending it (scrapes finish spread out)
COUNT_SECONDS = 1.0  # how often the child's counters are sent
# Hashes the child may hold for a parent that does not read (its loop stalled): past it they are
# replaced by clearing their pods (a lookup may then undercount, never count a block evicted).
MAX_PENDING_HASHES = 1 << 20


class CollectorProcess:
    """The parent's side: starts the child, keeps it told of the pods, applies what it sends."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        # The child logs as the parent does.
        self.log_level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
        self.proc: asyncio.subprocess.Process | None = None  # the child running now

    async def run(self) -> None:
        while True:
            try:
                await self._child()
            except asyncio.CancelledError:
                raise
            except Exception:  # a broken child is restarted, never the end of the router
                log.exception("the collectors' process failed")
            for pod in list(self.fleet.snapshots):
                self.fleet.kv.drop(pod)
            metrics.KV_BLOCKS.set(self.fleet.kv.entries())
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
        feeding = asyncio.create_task(self._feed(proc.stdin))
        try:
            while (payload := await channel.read_frame(proc.stdout)) is not None:
                self.apply(channel.to_parent.decode(payload))
            log.error("the collectors' process ended", extra={"returncode": await proc.wait()})
        finally:
            feeding.cancel()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    async def _feed(self, stdin: asyncio.StreamWriter) -> None:
        settings = self.fleet.settings.model_dump(mode="json")
        key = self.fleet.settings.pod_api_key
        settings["pod_api_key"] = None if key is None else key.get_secret_value()
        stdin.write(channel.frame(channel.Start(settings, self.log_level)))
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
            for snap in message.snaps:
                fleet.store(snap)
        elif isinstance(message, channel.KvOps):
            index = fleet.kv
            for op in message.ops:
                if op.kind == channel.STORED:
                    index.stored(op.pod, op.hashes, op.block_size)
                elif op.kind == channel.REMOVED:
                    index.removed(op.pod, op.hashes)
                elif op.kind == channel.CLEARED:
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
        self.outbox.kv(KvOp(channel.STORED, pod, list(hashes), block_size))

    def removed(self, pod: PodId, hashes: Iterable[int]) -> None:
        self.outbox.kv(KvOp(channel.REMOVED, pod, list(hashes)))

    def cleared(self, pod: PodId) -> None:
        self.outbox.kv(KvOp(channel.CLEARED, pod))

    def drop(self, pod: PodId) -> None:
        self.outbox.kv(KvOp(channel.DROP, pod))


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
        self.hashes += len(op.hashes)
        if self.hashes > MAX_PENDING_HASHES:
            pods = dict.fromkeys(o.pod for o in self.ops)
            self.ops = [KvOp(channel.CLEARED, pod) for pod in pods]
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
            if self.ops:
                self.out.write(channel.frame(channel.KvOps(self.ops)))
                self.ops, self.hashes = [], 0
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
    ]
    if fleet.settings.kv_events is not None:
        subscriber = KvEventSubscriber(fleet, fleet.settings.kv_events, _Recorder(outbox))
        tasks.append(asyncio.create_task(subscriber.run()))
    try:
        while (payload := await channel.read_frame(reader)) is not None:
            message = channel.to_child.decode(payload)
            if isinstance(message, channel.Pods):
                fleet.set_pods(message.pods)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
