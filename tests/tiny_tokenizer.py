"""The tiny model's tokenizer as its directory holds it (tools/tinymodel.py), made without vLLM:
tokenizer.json, the chat template beside it, the special tokens in tokenizer_config.json."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from tools.tinymodel import CHAT_TEMPLATE, byte_level_bpe


def write(directory: Path) -> Path:
    """The tokenizer.json's path."""
    directory.mkdir(parents=True, exist_ok=True)
    byte_level_bpe().save(str(directory / "tokenizer.json"))
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(special))
    return directory / "tokenizer.json"


def tokens(path: Path, text: str) -> int:
    """`text`'s tokens, as the tokenizer alone encodes it (no template, no special tokens)."""
    return len(Tokenizer.from_file(str(path)).encode(text, add_special_tokens=False).ids)
