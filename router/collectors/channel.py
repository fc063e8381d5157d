"""What the collectors' process (router/collectors/process.py) and the router holding the fleet
say to each other over the child's stdin and stdout: length-prefixed msgpack frames of one typed
union each way.

Parent → child: `Start` once (the fleet's settings, secrets included: never on the command line),
then `Pods` whenever the fleet's pods change. Child → parent: each pod's latest scrape
(`Scraped`), the KV index's operations in the order the pods' events gave them (`KvOps`), and
the child's counters' growth (`Counted`), each batched over a few milliseconds.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from router.types import PodId, PodMetrics

# Frames are the child's own, but a corrupt stream must not allocate without bound.
MAX_FRAME_BYTES = 256 << 20
_LENGTH = 4


class Start(msgspec.Struct, tag=True):
    fleet: dict[str, Any]  # FleetSettings as JSON, its secrets in clear (process.py)
    log_level: str


class Pods(msgspec.Struct, tag=True):
    pods: list[PodId]


class Scraped(msgspec.Struct, tag=True):
    snaps: list[PodMetrics]


# The KV index's operations (router/kvindex.py), applied by the parent in the order given.
class Stored(msgspec.Struct, tag=True, array_like=True):
    pod: PodId
    hashes: list[int]
    block_size: int


class Removed(msgspec.Struct, tag=True, array_like=True):
    pod: PodId
    hashes: list[int]


class Cleared(msgspec.Struct, tag=True, array_like=True):
    pod: PodId


class Dropped(msgspec.Struct, tag=True, array_like=True):
    pod: PodId


KvOp = Stored | Removed | Cleared | Dropped


class KvOps(msgspec.Struct, tag=True):
    ops: list[KvOp]


class Counted(msgspec.Struct, tag=True):
    """The child's counters' growth since the last `Counted`, by label."""

    scrape_errors: dict[PodId, float] = {}
    kv_batches: dict[str, float] = {}


ToChild = Start | Pods
ToParent = Scraped | KvOps | Counted

_encoder = msgspec.msgpack.Encoder()


def frame(message: ToChild | ToParent) -> bytes:
    payload = _encoder.encode(message)
    return len(payload).to_bytes(_LENGTH, "big") + payload


async def read_frame(reader: asyncio.StreamReader) -> bytes | None:
    """The next frame's payload; None at the end of the stream."""
    try:
        head = await reader.readexactly(_LENGTH)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise ValueError("the stream ended inside a frame") from exc
        return None
    size = int.from_bytes(head, "big")
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"a frame of {size} bytes")
    return await reader.readexactly(size)


to_child = msgspec.msgpack.Decoder(ToChild)
to_parent = msgspec.msgpack.Decoder(ToParent)
