"""A tiny Llama for real vLLM pods on CPU, made on the spot: no download, the same bytes each run.

Run by the vLLM environment's interpreter (`.venv-vllm/bin/python tools/tinymodel.py OUT`): it
needs torch, transformers and tokenizers, which the services' environment does not have. Random
weights (seed fixed) answer gibberish; what the tests need is the engine's real behaviour.
Head size 64: the CPU attention kernels refuse smaller heads at the first request.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

SEED = 20261203
VOCAB = 1024
# A chat template as simple as vLLM accepts: role and content, then the generation prompt.
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)
TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Large language models are served by pods behind a gateway that meters every token.",
    "Tenants share one fleet; quotas, queues and caches keep them apart.",
    "Hello, how are you today? I am fine, thank you. What is the weather like?",
    "0123456789 +-*/=()[]{}<>,.;:!?'\" abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
]


def byte_level_bpe() -> Any:
    """The model's tokenizer (a `tokenizers.Tokenizer`): byte-level BPE trained on TEXT, the same
    each run. Only `tokenizers` needed: the services' environment makes it too (tests)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(TEXT * 4, trainer=trainer)
    return bpe


def write_tokenizer(directory: Path) -> Path:
    """The tokenizer as the model's directory holds it (tokenizer.json, the chat template beside
    it, the special tokens in tokenizer_config.json), without transformers: its tokenizer.json's
    path."""
    directory.mkdir(parents=True, exist_ok=True)
    byte_level_bpe().save(str(directory / "tokenizer.json"))
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(special))
    return directory / "tokenizer.json"


def make(out: Path) -> None:
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    torch.manual_seed(SEED)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=byte_level_bpe(), bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    tmp = out.with_name(out.name + ".partial")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)  # whole or absent: a run killed halfway leaves no half model


if __name__ == "__main__":
    make(Path(sys.argv[1]))
