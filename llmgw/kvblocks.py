"""vLLM's prefix-cache block hashes of a prompt, computed as its pods compute them and in the form
their KV events publish them, so that the router can look a request's blocks up in what each pod
reports holding (router/kvindex.py).

A pod hashes each full block of `block_size` prompt tokens as `H((parent, tokens, extra))`: the
parent is the block before's hash (the first block's is `H(seed)`), `extra` is
`(("cache_salt", salt),)` on the first block of a salted request, else None; H is the pod's
`--prefix-caching-hash-algo` (sha256 of the pickled tuple, or sha256_cbor of its canonical CBOR).
The seed is the pod's PYTHONHASHSEED, else "vllm-none-hash" (vLLM 0.32, v1/core/kv_cache_utils.py):
pods and router are configured alike (tools/engine.py). Events carry each hash's last 8 bytes as
an unsigned integer (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, on by default), as do these.
Checked against a real pod's events: tests/llmgw/test_kvblocks.py (recorded),
tests/e2e/test_vllm_fleet.py (live).
"""

from __future__ import annotations

import functools
import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any, Literal

import cbor2
from pydantic import Field

from llmgw import kvevents
from llmgw.config import Strict

HashAlgo = Literal["sha256", "sha256_cbor"]
# vLLM's seed when PYTHONHASHSEED is unset and the algorithm is cryptographic.
DEFAULT_SEED = "vllm-none-hash"


class KvHashing(Strict):
    """How the pods hash their prefix-cache blocks: the router computes a request's alike."""

    algo: HashAlgo = "sha256"  # the pods' --prefix-caching-hash-algo
    seed: str = DEFAULT_SEED  # the pods' PYTHONHASHSEED, where set
    block_size: int = Field(default=16, ge=1)  # vllm:cache_config_info's (128 on CPU builds)
    max_blocks: int = Field(default=64, ge=0)  # leading blocks hashed per request


def _sha256(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(value: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {"sha256": _sha256, "sha256_cbor": _sha256_cbor}


@functools.cache
def _root(algo: str, seed: str) -> bytes:
    return _FUNCTIONS[algo](seed)


def block_hashes(tokens: Sequence[int], hashing: KvHashing, salt: str = "") -> tuple[int, ...]:
    """The published hashes of the prompt's leading full blocks (at most `max_blocks`)."""
    size = hashing.block_size
    count = min(len(tokens) // size, hashing.max_blocks)
    if count == 0:
        return ()
    fn = _FUNCTIONS[hashing.algo]
    parent = _root(hashing.algo, hashing.seed)
    extra: tuple[tuple[str, str], ...] | None = (("cache_salt", salt),) if salt else None
    out: list[int] = []
    for start in range(0, count * size, size):
        parent = fn((parent, tuple(tokens[start : start + size]), extra))
        out.append(kvevents.hash_value(parent))
        extra = None
    return tuple(out)
