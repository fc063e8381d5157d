"""Cheap, deterministic stand-ins for a tokenizer, a chat template and a model's output.

A token is 4 characters of the rendered prompt, so the same text always costs the same and
block `i` of a prompt is simply characters [4*bs*i, 4*bs*(i+1)).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator, Sequence

CHARS_PER_TOKEN = 4
MIN_OUTPUT, MAX_OUTPUT = 16, 256

_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "it",
    "for",
    "as",
    "with",
    "was",
    "on",
    "be",
    "by",
    "at",
    "this",
    "from",
    "or",
    "have",
    "an",
    "are",
    "not",
    "but",
    "had",
    "they",
    "which",
    "one",
    "you",
    "were",
    "all",
    "we",
    "can",
    "her",
    "has",
    "there",
    "been",
    "if",
    "more",
    "when",
    "will",
    "would",
    "who",
    "so",
    "no",
    "model",
    "token",
    "cache",
    "batch",
    "queue",
    "prefill",
    "decode",
    "stream",
    "block",
    "kernel",
    "tensor",
]


def render_chat(messages: Sequence[tuple[str, str]]) -> str:
    """A Llama-3-style template: messages sharing a prefix render to a shared prefix."""
    parts = ["<|begin_of_text|>"]
    for role, content in messages:
        parts.append(f"<|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>")
    parts.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(parts)


def count_tokens(text: str) -> int:
    return max(1, -(-len(text) // CHARS_PER_TOKEN))


def block_hashes(text: str, block_size: int, salt: str = "") -> list[int]:
    """Hash chain over the prompt's full blocks: each hash covers the block and all before it,
    and the salt (vLLM's cache_salt enters the first block's hash)."""
    width = block_size * CHARS_PER_TOKEN
    hashes: list[int] = []
    prev = hash(("salt", salt)) if salt else 0
    for start in range(0, len(text) - width + 1, width):
        prev = hash((prev, text[start : start + width]))
        hashes.append(prev)
    return hashes


EOS = ""  # the end-of-sequence token: counted in usage, detokenised to nothing


def _digest(seed: int, text: str, sample: int) -> int:
    # Sample 0 keeps the digest of a plain (seed, text): n=1 answers never change.
    key = f"{seed}\0{text}" + (f"\0{sample}" if sample else "")
    h = hashlib.blake2b(key.encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little")


def natural_length(seed: int, prompt: str, sample: int = 0) -> int:
    """How many tokens the 'model' says, its end-of-sequence token included."""
    return MIN_OUTPUT + _digest(seed, prompt, sample) % (MAX_OUTPUT - MIN_OUTPUT + 1)


def words(seed: int, prompt: str, sample: int = 0) -> Iterator[str]:
    """The generated tokens: pseudo-words, the same for the same seed, prompt and sample."""
    rng = random.Random(_digest(seed + 1, prompt, sample))
    while True:
        yield " " + rng.choice(_WORDS)
