"""Every pod's KV events (llmgw/kvevents.py), applied to the fleet's KV index (router/kvindex.py)
in the order the pod published them.

One SUB socket per pod of the fleet, connected to where it publishes (settings `kv_events`);
pods that leave the fleet are unsubscribed and forgotten. Each connection begins with a replay
of what the pod still buffers (a new subscriber, or a restarted router, learns the pod's past);
a disconnection drops the pod's entries (the pod may be restarting: a new process has an empty
cache and counts its batches from 0 again). Each batch's sequence is checked against the one
before: one already applied is skipped; a gap (ZMQ drops messages past its high-water mark) is
filled from the replay socket, and what no replay fills drops the pod's entries (known empty: a
lookup then undercounts, never sends a request to blocks the pod evicted while the router was
not listening).
"""

from __future__ import annotations

import asyncio
import logging

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
MAX_REPLAY_BATCHES = 100_000  # vLLM buffers 10,000 (buffer_steps)


class _Feed:
    """One pod's subscription: the last sequence applied, and the lock that keeps the live
    batches and the replays in order."""

    def __init__(self) -> None:
        self.last: int | None = None
        self.lock = asyncio.Lock()


class KvEventSubscriber:
    def __init__(self, fleet: Fleet, settings: KvEventSettings) -> None:
        self.fleet = fleet
        self.settings = settings
        self.index: KvIndex = fleet.kv
        self._ctx = zmq.asyncio.Context()
        self._tasks: dict[PodId, asyncio.Task[None]] = {}

    async def run(self) -> None:
        try:
            while True:
                self.reconcile()
                await asyncio.sleep(RECONCILE_SECONDS)
        finally:
            for task in self._tasks.values():
                task.cancel()
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)
            self._ctx.destroy(linger=0)

    def reconcile(self) -> None:
        """Subscribe to the fleet's new pods, unsubscribe from the ones gone."""
        pods = self.fleet.snapshots
        for pod in [p for p in self._tasks if p not in pods]:
            self._tasks.pop(pod).cancel()
            self.index.drop(pod)
        for pod in pods:
            if pod in self._tasks:
                continue
            endpoint = self.settings.endpoint(pod)
            if endpoint is not None:
                self._tasks[pod] = asyncio.create_task(self._follow(pod, endpoint))

    async def _follow(self, pod: PodId, endpoint: KvEndpoint) -> None:
        s = self.settings
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, s.max_message_bytes)
        sock.setsockopt(zmq.SUBSCRIBE, s.topic.encode())
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sock.connect(endpoint.publish)
        feed = _Feed()
        watch = asyncio.create_task(self._watch(pod, endpoint, monitor, feed))
        try:
            while True:
                frames = await sock.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    metrics.KV_BATCHES.labels("malformed").inc()
                    continue
                async with feed.lock:
                    await self._receive(
                        pod, endpoint, feed, kvevents.sequence(frames[1]), frames[2]
                    )
        except asyncio.CancelledError:
            raise
        except Exception:  # one pod's socket never stops the others' (nor the router)
            log.exception("KV-event subscription ended", extra={"pod": pod})
            self.index.cleared(pod)
            self._tasks.pop(pod, None)  # subscribed again at the next reconcile
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)

    async def _watch(
        self, pod: PodId, endpoint: KvEndpoint, monitor: zmq.asyncio.Socket, feed: _Feed
    ) -> None:
        """Connected: what the pod still buffers, replayed. Disconnected: its entries dropped."""
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            async with feed.lock:
                if event == zmq.EVENT_DISCONNECTED:
                    metrics.KV_BATCHES.labels("disconnected").inc()
                    self.index.cleared(pod)
                    feed.last = None
                elif event == zmq.EVENT_CONNECTED and feed.last is None:
                    for seq, payload in await self._replay(endpoint, 0, None) or ():
                        metrics.KV_BATCHES.labels("replayed").inc()
                        self.apply(pod, payload)
                        feed.last = seq

    async def _receive(
        self, pod: PodId, endpoint: KvEndpoint, feed: _Feed, seq: int, payload: bytes
    ) -> None:
        last = feed.last
        if last is not None and seq <= last:
            return  # replayed already
        if (last is None and seq > 0) or (last is not None and seq > last + 1):
            await self._fill(pod, endpoint, 0 if last is None else last + 1, seq, last)
        self.apply(pod, payload)
        feed.last = seq

    async def _fill(
        self, pod: PodId, endpoint: KvEndpoint, start: int, until: int, last: int | None
    ) -> None:
        """The batches [start, until) from the pod's replay socket; the pod's entries dropped
        where some are missing (a first subscription keeps what it learns: nothing yet)."""
        batches = await self._replay(endpoint, start, until)
        complete = batches is not None and [q for q, _ in batches] == list(range(start, until))
        if not complete and last is not None:
            metrics.KV_BATCHES.labels("lost").inc()
            self.index.cleared(pod)
        for _, payload in batches or ():
            metrics.KV_BATCHES.labels("replayed").inc()
            self.apply(pod, payload)

    async def _replay(
        self, endpoint: KvEndpoint, start: int, until: int | None
    ) -> list[tuple[int, bytes]] | None:
        """The batches the pod still buffers from `start` on (before `until`), in order; None
        where it has no replay socket or does not answer in time."""
        if endpoint.replay is None:
            return None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.settings.max_message_bytes)
        got: list[tuple[int, bytes]] = []
        try:
            sock.connect(endpoint.replay)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            async with asyncio.timeout(self.settings.replay_timeout):
                while True:
                    frames = await sock.recv_multipart()
                    if len(frames) != 4 or len(frames[2]) != 8:
                        return None
                    if frames[2] == kvevents.END_SEQUENCE:
                        return got
                    seq = kvevents.sequence(frames[2])
                    if start <= seq and (until is None or seq < until):
                        got.append((seq, frames[3]))
                        if len(got) > MAX_REPLAY_BATCHES:  # more than any pod buffers
                            return None
        except (TimeoutError, zmq.ZMQError):
            return None
        finally:
            sock.close(linger=0)

    def apply(self, pod: PodId, payload: bytes) -> None:
        try:
            batch = kvevents.decode(payload)
        except ValueError:
            metrics.KV_BATCHES.labels("malformed").inc()
            return
        index = self.index
        for event in batch.events:
            if isinstance(event, kvevents.BlockStored):
                if event.medium in kvevents.DEVICE_MEDIA and event.block_size > 0:
                    hashes = map(kvevents.hash_value, event.block_hashes)
                    index.stored(pod, hashes, event.block_size)
            elif isinstance(event, kvevents.BlockRemoved):
                if event.medium in kvevents.DEVICE_MEDIA:
                    index.removed(pod, map(kvevents.hash_value, event.block_hashes))
            else:
                index.cleared(pod)
        metrics.KV_BATCHES.labels("applied").inc()
        metrics.KV_BLOCKS.set(index.entries())


async def run(fleet: Fleet) -> None:
    """The subscriber of the fleet's settings, until cancelled (nothing without `kv_events`)."""
    settings = fleet.settings.kv_events
    if settings is None:
        return
    await KvEventSubscriber(fleet, settings).run()
