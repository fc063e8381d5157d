"""Every pod's KV events (llmgw/kvevents.py), applied to the fleet's KV index (router/kvindex.py)
in the order the pod published them.

One SUB socket per pod of the fleet, connected to where it publishes (settings `kv_events`);
pods that leave the fleet are unsubscribed and forgotten. Each connection begins with a replay
of what the pod still buffers (a new subscriber, or a restarted router, learns the pod's past).
A disconnection drops the pod's entries and the socket with whatever it still queues (the pod
may be restarting: a new process has an empty cache and counts its batches from 0 again, and a
batch of the old one read after that would be taken for the new one's); a new socket connects
and replays. Each batch's sequence is checked against the one before: one already applied is
skipped; a gap (ZMQ drops messages past its high-water mark) is filled from the replay socket.
A replay that leaves a hole (its ROUTER socket drops past its own high-water mark) drops the
pod's entries and applies only the unbroken run of batches that ends at the newest: a lookup may
undercount, but never counts a block whose eviction the router missed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from llmgw import kvevents
from router import metrics
from router.fleet import Fleet, KvEndpoint, KvEventSettings
from router.kvindex import KvIndex
from router.types import PodId

log = logging.getLogger(__name__)

RECONCILE_SECONDS = 0.5  # how soon a pod new to the fleet is subscribed to
RESUBSCRIBE_SECONDS = 0.1  # after a disconnection or a failed socket, before the next one
APPLIED_BEFORE_YIELD = 256  # a long replay lets the checks run between its batches
# vLLM's events for anything but its full-attention cache (sliding window, Mamba) describe
# other blocks under other sizes: not what a prompt's prefix hits.
FULL_ATTENTION = frozenset({None, "full_attention"})

Batches = Sequence[tuple[int, bytes]]


class KvEventSubscriber:
    def __init__(
        self, fleet: Fleet, settings: KvEventSettings, index: KvIndex | None = None
    ) -> None:
        self.fleet = fleet
        self.settings = settings
        self.index = fleet.kv if index is None else index  # (the collectors' process records)
        self._ctx: zmq.asyncio.Context | None = None  # run's
        self._tasks: dict[PodId, asyncio.Task[None]] = {}
        self._groups: dict[PodId, set[int | None]] = {}  # each pod's full-attention groups

    async def run(self) -> None:
        self._ctx = zmq.asyncio.Context()
        try:
            while True:
                self.reconcile()
                await asyncio.sleep(RECONCILE_SECONDS)
        finally:
            for task in self._tasks.values():
                task.cancel()
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)
            self._ctx.destroy(linger=0)
            self._ctx = None

    def reconcile(self) -> None:
        """Subscribe to the fleet's new pods, unsubscribe from the ones gone."""
        pods = self.fleet.snapshots
        for pod in [p for p in self._tasks if p not in pods]:
            self._tasks.pop(pod).cancel()
            self.index.drop(pod)
            self._groups.pop(pod, None)
        for pod in pods:
            if pod in self._tasks:
                continue
            endpoint = self.settings.endpoint(pod)
            if endpoint is not None:
                self._tasks[pod] = asyncio.create_task(self._follow(pod, endpoint))

    async def _follow(self, pod: PodId, endpoint: KvEndpoint) -> None:
        """Subscriptions to the pod, one after another: each lasts until it disconnects."""
        while True:
            try:
                await self._subscription(pod, endpoint)
            except asyncio.CancelledError:
                raise
            except Exception:  # one pod's socket never stops the others' (nor the router)
                log.exception("KV-event subscription failed", extra={"pod": pod})
            self.index.cleared(pod)
            await asyncio.sleep(RESUBSCRIBE_SECONDS)

    async def _subscription(self, pod: PodId, endpoint: KvEndpoint) -> None:
        s = self.settings
        assert self._ctx is not None  # in run
        sock = self._ctx.socket(zmq.SUB)
        monitor: zmq.asyncio.Socket | None = None
        waits: dict[str, asyncio.Future[list[bytes]]] = {}
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IPV6, 1)  # a pod's address may be one (IPv4 works too)
            sock.setsockopt(zmq.MAXMSGSIZE, s.max_message_bytes)
            sock.setsockopt(zmq.SUBSCRIBE, s.topic.encode())
            monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            sock.connect(endpoint.publish)
            last: int | None = None
            while True:
                # The monitor first: a disconnection ends the subscription before any batch
                # still queued behind it is read.
                if "event" not in waits:  # (not setdefault: its default would receive too)
                    waits["event"] = asyncio.ensure_future(monitor.recv_multipart())
                if "batch" not in waits:
                    waits["batch"] = asyncio.ensure_future(sock.recv_multipart())
                await asyncio.wait(waits.values(), return_when=asyncio.FIRST_COMPLETED)
                if waits["event"].done():
                    event = parse_monitor_message(waits.pop("event").result())["event"]
                    if event == zmq.EVENT_DISCONNECTED:
                        metrics.KV_BATCHES.labels("disconnected").inc()
                        return
                    if event == zmq.EVENT_CONNECTED and last is None:
                        last = await self._catch_up(pod, endpoint, 0, None, last)
                    continue
                frames = waits.pop("batch").result()
                if len(frames) != 3 or len(frames[1]) != 8:
                    metrics.KV_BATCHES.labels("malformed").inc()
                    continue
                seq = kvevents.sequence(frames[1])
                if last is not None and seq <= last:
                    continue  # replayed already
                start = 0 if last is None else last + 1
                if seq > start:
                    last = await self._catch_up(pod, endpoint, start, seq, last)
                self.apply(pod, frames[2])
                last = seq
        finally:
            for wait in waits.values():
                wait.cancel()
            if monitor is not None:
                sock.disable_monitor()
                monitor.close(linger=0)
            sock.close(linger=0)

    async def _catch_up(
        self, pod: PodId, endpoint: KvEndpoint, start: int, until: int | None, last: int | None
    ) -> int | None:
        """The batches from `start` (before `until`) from the pod's replay socket, applied; the
        last sequence applied. Where some are missing, the pod's entries are dropped and only
        the unbroken run that ends at the newest is applied (a first subscription with no
        replay keeps what it learns from now on: nothing yet)."""
        batches = await self._replay(endpoint, start, until)
        seqs = [q for q, _ in batches]
        end = until if until is not None else (seqs[-1] + 1 if seqs else start)
        if seqs == list(range(start, end)):
            run: Batches = batches
        else:
            if last is not None or batches:
                metrics.KV_BATCHES.labels("lost").inc()
                self.index.cleared(pod)
            run = _unbroken_tail(batches, end)
        for i, (seq, payload) in enumerate(run):
            metrics.KV_BATCHES.labels("replayed").inc()
            self.apply(pod, payload)
            last = seq
            if i % APPLIED_BEFORE_YIELD == APPLIED_BEFORE_YIELD - 1:
                await asyncio.sleep(0)
        return last

    async def _replay(
        self, endpoint: KvEndpoint, start: int, until: int | None
    ) -> list[tuple[int, bytes]]:
        """The batches the pod still buffers from `start` on (before `until`), as received; none
        where it has no replay socket, and what came until then where it does not finish in
        time or past the byte budget."""
        got: list[tuple[int, bytes]] = []
        if endpoint.replay is None:
            return got
        s = self.settings
        assert self._ctx is not None  # in run
        sock = self._ctx.socket(zmq.DEALER)
        size = 0
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IPV6, 1)
            sock.setsockopt(zmq.MAXMSGSIZE, s.max_message_bytes)
            sock.setsockopt(zmq.RCVHWM, 0)  # what the pod sends is the budget's to bound
            sock.connect(endpoint.replay)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            async with asyncio.timeout(s.replay_timeout):
                while size <= s.max_replay_bytes:
                    frames = await sock.recv_multipart()
                    if len(frames) != 4 or len(frames[2]) != 8:
                        break
                    if frames[2] == kvevents.END_SEQUENCE:
                        break
                    seq = kvevents.sequence(frames[2])
                    if start <= seq and (until is None or seq < until):
                        got.append((seq, frames[3]))
                        size += len(frames[3])
        except (TimeoutError, zmq.ZMQError):
            pass
        finally:
            sock.close(linger=0)
        return got

    def apply(self, pod: PodId, payload: bytes) -> None:
        try:
            batch = kvevents.decode(payload)
        except ValueError:
            metrics.KV_BATCHES.labels("malformed").inc()
            return
        index = self.index
        groups = self._groups.setdefault(pod, set())
        for event in batch.events:
            if isinstance(event, kvevents.BlockStored):
                if (
                    event.medium in kvevents.DEVICE_MEDIA
                    and event.kv_cache_spec_kind in FULL_ATTENTION
                    and event.block_size > 0
                ):
                    groups.add(event.group_idx)
                    hashes = map(kvevents.hash_value, event.block_hashes)
                    index.stored(pod, hashes, event.block_size)
            elif isinstance(event, kvevents.BlockRemoved):
                if event.medium in kvevents.DEVICE_MEDIA and event.group_idx in groups:
                    index.removed(pod, map(kvevents.hash_value, event.block_hashes))
            else:
                index.cleared(pod)
        metrics.KV_BATCHES.labels("applied").inc()
        metrics.KV_BLOCKS.set(index.entries())


def _unbroken_tail(batches: Batches, end: int) -> Batches:
    """The batches of the unbroken run of sequences that ends at `end` - 1 (none if the newest
    is missing)."""
    i = len(batches)
    while i > 0 and batches[i - 1][0] == end - (len(batches) - i) - 1:
        i -= 1
    return batches[i:]


async def run(fleet: Fleet) -> None:
    """The subscriber of the fleet's settings, until cancelled (nothing without `kv_events`)."""
    settings = fleet.settings.kv_events
    if settings is None:
        return
    await KvEventSubscriber(fleet, settings).run()
