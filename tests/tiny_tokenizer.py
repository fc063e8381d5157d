"""The tiny model's tokenizer as its directory holds it (tools/tinymodel.py), made without vLLM."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from tools.tinymodel import write_tokenizer as write

__all__ = ["tokens", "write"]


def tokens(path: Path, text: str) -> int:
    """`text`'s tokens, as the tokenizer alone encodes it (no template, no special tokens)."""
    return len(Tokenizer.from_file(str(path)).encode(text, add_special_tokens=False).ids)
