"""vLLM's KV-cache events on the wire: the one definition the router decodes
(router/collectors/kvevents.py) and the simulator publishes (sim/kvevents.py).

A pod started with `--kv-events-config` publishes on a ZMQ PUB socket multipart messages
`[topic, sequence, payload]`: the sequence an 8-byte big-endian counter from 0 at the pod's
start, the payload a msgpack `EventBatch` (an array `[ts, events, data_parallel_rank]`), each
event a map tagged by its `type` (vLLM 0.32, vllm/distributed/kv_events.py). Its ROUTER replay
socket answers a request `[b"", start sequence]` with every batch it still buffers from there,
each `[b"", topic, sequence, payload]`, then `[b"", b"", END, b""]`. Declared: what the router
reads and vLLM requires of a batch (the simulator publishes those); msgspec skips the rest, so
newer pods' additions decode.
"""

from __future__ import annotations

import msgspec

END_SEQUENCE = (-1).to_bytes(8, "big", signed=True)
_LOW64 = (1 << 64) - 1
# The medium a pod's own cache is on (CPU builds say GPU too); offloaded tiers are not a hit.
DEVICE_MEDIA = frozenset({None, "GPU"})


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None  # "full_attention", "sliding_window", "mamba", …


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(EventBatch)
_encoder = msgspec.msgpack.Encoder()


def decode(payload: bytes) -> EventBatch:
    """Raises msgspec.DecodeError (a ValueError) on a payload that is not a batch."""
    return _decoder.decode(payload)


def encode(batch: EventBatch) -> bytes:
    return _encoder.encode(batch)


def hash_value(h: int | bytes) -> int:
    """A block hash as the index keys it: its low 64 bits, as pods publish it by default (an
    integer), or from the bytes they publish with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0."""
    return (h if isinstance(h, int) else int.from_bytes(h, "big")) & _LOW64


def sequence(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)
