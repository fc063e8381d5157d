"""The pod's KV events as vLLM publishes them (llmgw/kvevents.py): a PUB socket, one batch per
engine step that stored or evicted blocks, and a ROUTER socket replaying the last
`buffer_steps` batches from a requested sequence on.

The `kv_events_paused` fault keeps batches for replay without sending them, as ZMQ drops what
passes a subscriber's high-water mark.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque

import zmq
import zmq.asyncio

from llmgw import kvevents
from sim.faults import FaultState
from sim.types import KvEventsConfig

log = logging.getLogger(__name__)


class KvEventPublisher:
    def __init__(self, config: KvEventsConfig, faults: FaultState) -> None:
        self.config = config
        self.faults = faults
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(config.endpoint)
        self._replay: zmq.asyncio.Socket | None = None
        if config.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(config.replay_endpoint)
        self._topic = config.topic.encode()
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._replay is not None:
            self._task = asyncio.create_task(self._serve_replay(self._replay))

    def publish(self, events: list[kvevents.Event]) -> None:
        """One batch, now (never blocks: past the high-water mark ZMQ drops it, as vLLM's)."""
        if not events:
            return
        seq, self._seq = self._seq, self._seq + 1
        payload = kvevents.encode(kvevents.EventBatch(time.time(), events, 0))
        self._buffer.append((seq, payload))
        if self.faults.current.kv_events_paused:
            return
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)

    async def _serve_replay(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("invalid KV-event replay request")
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    msg = (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                    await sock.send_multipart(msg)
            await sock.send_multipart((client, b"", b"", kvevents.END_SEQUENCE, b""))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._ctx.destroy(linger=0)
