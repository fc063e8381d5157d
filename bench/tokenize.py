"""What counting prompts with the model's tokenizer costs extauthz, per request and per MiB.

extauthz reads each body once (extauthz/body.py: JSON parse, facts); with a tokenizer configured
for the model (decision.tokenizer) that read also renders the chat template and tokenizes it.
The read runs in the body pool's worker from `pool_tokenized_body_bytes` (8 KiB) on, inline
below. This times the read with and without the tokenizer, one process, one core, for chat
bodies of English, CJK and emoji text; the difference is the tokenizer's cost. Then hashing the
prompt's leading KV blocks as the pods do (llmgw/kvblocks.py, at most `max_blocks` = 64 of them,
once per request for its tenant's salt): with vLLM's GPU block of 16 tokens and the CPU
build's 128.

    python -m bench.tokenize [--tokenizer PATH] [--seconds 1.0]

Without --tokenizer: the tiny test model's (tools/tinymodel.py, byte-level BPE of 1,024 tokens:
a CJK character is 3 tokens). A real model's (Llama 3's 128k vocabulary) merges more: run with it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from extauthz.body import read
from extauthz.settings import DecisionSettings
from llmgw import kvblocks, tokenizer
from llmgw.kvblocks import KvHashing
from tools.tinymodel import write_tokenizer

MODEL = "m"
TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog. ",
    "cjk": "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(64)),
    "emoji": "".join(chr(0x1F300 + i % 300) for i in range(64)),
}
SIZES = (256, 8 * 1024, 64 * 1024, 256 * 1024, 1024 * 1024)


def body(text: str, size: int) -> bytes:
    """A chat body of about `size` bytes of `text`."""
    content = (text * (size // len(text.encode()) + 1))[: max(1, size // len(text[0].encode()))]
    return json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 16},
        ensure_ascii=False,
    ).encode()


def per_call(call: Callable[[], object], seconds: float) -> float:
    """Seconds per call, the mean over as many calls as fit in `seconds` (at least 3)."""
    call()  # warm: the tokenizer loaded, caches filled
    n, started = 0, time.perf_counter()
    while n < 3 or time.perf_counter() - started < seconds:
        call()
        n += 1
    return (time.perf_counter() - started) / n


def per_read(raw: bytes, settings: DecisionSettings, seconds: float) -> float:
    return per_call(lambda: read(raw, settings), seconds)


def per_hash(raw: bytes, settings: DecisionSettings, block_size: int, seconds: float) -> float:
    """Seconds to hash the body's leading KV blocks for one tenant (salted)."""
    hashing = KvHashing(block_size=block_size)
    prompt = tokenizer.counter(settings.tokenizer[MODEL]).request(json.loads(raw), 0)
    ids = prompt.ids if prompt is not None else ()
    return per_call(lambda: kvblocks.block_hashes(ids, hashing, "0123456789abcdef"), seconds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", type=Path, help="a tokenizer.json (default: the tiny model's)")
    p.add_argument("--seconds", type=float, default=1.0, help="timing per cell")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.tokenizer or write_tokenizer(Path(tmp))
        plain = DecisionSettings()
        # Past tokenize_max_bytes (256 KiB) extauthz estimates instead: counted here to measure.
        counted = DecisionSettings(tokenizer={MODEL: path}, tokenize_max_bytes=4 * 2**20)
        print(f"tokenizer: {path if args.tokenizer else 'the tiny model (tools/tinymodel.py)'}")
        print(f"{'text':<8} {'body':>9} {'tokens':>8} {'parse µs':>10} {'+count µs':>10} "
              f"{'count ms/MiB':>13} {'+hash µs 16':>12} {'+hash µs 128':>13}")  # fmt: skip
        for name, text in TEXTS.items():
            for size in SIZES:
                raw = body(text, size)
                base = per_read(raw, plain, args.seconds)
                full = per_read(raw, counted, args.seconds)
                tokens = read(raw, counted).facts.prompt_tokens
                extra = max(full - base, 0.0)
                per_mib = extra / (len(raw) / 2**20) * 1e3
                hashes = [per_hash(raw, counted, size, args.seconds) for size in (16, 128)]
                print(f"{name:<8} {len(raw):>9} {tokens:>8} {base * 1e6:>10.0f} "
                      f"{extra * 1e6:>10.0f} {per_mib:>13.0f} {hashes[0] * 1e6:>12.0f} "
                      f"{hashes[1] * 1e6:>13.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
