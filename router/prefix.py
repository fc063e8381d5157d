"""Prompt prefixes as chained block hashes, and which pods recently served which blocks.

The prompt is rendered the way a chat template would lay it out (role markers around each
message), cut into blocks of 16 "tokens" of ~4 characters, and each block's hash covers every block
before it, so equal hashes mean equal prefixes. The hashes are stable across processes.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Any

from router.types import PodId

BLOCK_TOKENS = 16
CHARS_PER_TOKEN = 4
BLOCK_CHARS = BLOCK_TOKENS * CHARS_PER_TOKEN


def render(body: dict[str, Any]) -> str:
    """Chat messages as a template would render them; a completions `prompt` as is."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for msg in messages:
            if not isinstance(msg, dict):
                continue
            content = msg.get("content")
            if isinstance(content, list):  # content parts: keep the text ones
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"<|{msg.get('role', '')}|>\n{content or ''}<|end|>\n")
        return "".join(parts)
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else ""


def is_first_turn(body: dict[str, Any]) -> bool:
    """A chat request with no assistant message yet, or a completions request."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return True
    return not any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages)


def block_hashes(text: str, max_blocks: int) -> tuple[int, ...]:
    """Chained hashes of the leading full blocks."""
    data = text.encode()
    out: list[int] = []
    prev = b""
    for start in range(0, min(len(data) // BLOCK_CHARS, max_blocks) * BLOCK_CHARS, BLOCK_CHARS):
        prev = hashlib.blake2b(prev + data[start : start + BLOCK_CHARS], digest_size=8).digest()
        out.append(int.from_bytes(prev, "big"))
    return tuple(out)


def parse_body(raw: bytes) -> dict[str, Any] | None:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return body if isinstance(body, dict) else None


class PrefixIndex:
    """Block hash → pods that recently served it; per pod an LRU sized like its KV cache."""

    def __init__(self) -> None:
        self._pods: dict[PodId, OrderedDict[int, None]] = {}
        self._where: dict[int, set[PodId]] = {}

    def match(self, blocks: tuple[int, ...]) -> dict[PodId, int]:
        """Per pod, how many leading blocks it holds."""
        depth: dict[PodId, int] = {}
        alive: set[PodId] | None = None
        for i, h in enumerate(blocks, 1):
            pods = self._where.get(h)
            if not pods:
                break
            alive = set(pods) if alive is None else alive & pods
            if not alive:
                break
            for pod in alive:
                depth[pod] = i
        return depth

    def record(self, pod: PodId, blocks: tuple[int, ...], capacity: int) -> None:
        lru = self._pods.setdefault(pod, OrderedDict())
        for h in reversed(blocks):  # leading blocks end most recent: the tail is evicted first
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                self._where.setdefault(h, set()).add(pod)
        while len(lru) > max(capacity, 0):
            old, _ = lru.popitem(last=False)
            holders = self._where.get(old)
            if holders is not None:
                holders.discard(pod)
                if not holders:
                    del self._where[old]

    def size(self, pod: PodId) -> int:
        return len(self._pods.get(pod, ()))
