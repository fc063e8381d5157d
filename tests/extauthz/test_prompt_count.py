"""What extauthz reserves for a prompt: with the model's tokenizer configured, the prompt's exact
count under it; without one, the estimate, and beside it a bound no byte-level tokenizer exceeds
(the prompt's UTF-8 bytes), which a stream cut short before any usage is charged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from extauthz.body import read
from extauthz.bodypool import BodyPool
from extauthz.settings import DecisionSettings
from llmgw.config import ConfigError, validate
from llmgw.facts import MESSAGE_TOKENS, PROMPT_SPECIAL_TOKENS
from llmgw.wire import CHAT_PATH as CHAT
from tests import tiny_tokenizer
from tests.extauthz.conftest import make_decider
from tests.tiny_tokenizer import tokens

MODEL = "tiny"
CJK = "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(4000))  # 3 bytes each
EMOJI = "".join(chr(0x1F300 + i % 300) for i in range(1000))  # 4 bytes each
DENSE = {"cjk": CJK, "emoji": EMOJI}


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_tokenizer.write(tmp_path_factory.mktemp("tiny"))


def chat(text: str) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 7}
    return json.dumps(body).encode()


@pytest.mark.parametrize("kind", sorted(DENSE))
def test_with_the_tokenizer_a_dense_prompt_reserves_its_exact_count(path: Path, kind: str) -> None:
    text = DENSE[kind]
    settings = DecisionSettings(tokenizer={MODEL: path})
    facts = read(chat(text), settings, CHAT).facts
    exact = tokens(path, f"<s>user: {text}</s>\n<s>assistant: ")
    assert exact >= len(text) * 3  # the tiny BPE: a token a byte (the estimate: 1,000 for 4,000)
    assert facts.prompt_tokens == facts.prompt_bound == exact
    assert facts.token_estimate == exact + 7


@pytest.mark.parametrize("kind", sorted(DENSE))
def test_without_it_the_estimate_stays_and_the_bound_is_the_utf8_bytes(
    path: Path, kind: str
) -> None:
    text = DENSE[kind]
    facts = read(chat(text), DecisionSettings(), CHAT).facts
    assert facts.prompt_tokens == -(-(len(text) + 4) // 4) + 2 * MESSAGE_TOKENS  # the estimate
    assert facts.prompt_bound == len(text.encode()) + 4 + 2 * MESSAGE_TOKENS
    # … at least the count under a byte-level tokenizer, the template's markers included.
    assert facts.prompt_ceiling >= tokens(path, f"<s>user: {text}</s>\n<s>assistant: ")


def test_a_completions_bound_holds_what_the_tokenizer_adds_to_each_prompt(path: Path) -> None:
    """A completion's prompt is tokenized with the special tokens its tokenizer adds (a BOS)."""
    prompts = {"model": MODEL, "prompt": [CJK[:10], "ab"], "max_tokens": 1}
    facts = read(json.dumps(prompts).encode(), DecisionSettings(), "/v1/completions").facts
    assert facts.prompt_bound == 30 + 2 + 2 * PROMPT_SPECIAL_TOKENS
    assert facts.prompt_tokens == -(-12 // 4)


def test_another_model_is_estimated(path: Path) -> None:
    settings = DecisionSettings(tokenizer={"other": path})
    facts = read(chat(CJK), settings, CHAT).facts
    assert facts.prompt_tokens < len(CJK) // 2 < facts.prompt_bound


def test_a_prompt_over_tokenize_max_bytes_is_estimated_and_bounded(path: Path) -> None:
    """No body holds the pool's worker for long: past the cap, as without a tokenizer."""
    size = len(CJK.encode()) + 4 + 2 * MESSAGE_TOKENS
    counted = read(
        chat(CJK), DecisionSettings(tokenizer={MODEL: path}, tokenize_max_bytes=size), CHAT
    )
    assert counted.facts.prompt_tokens == counted.facts.prompt_bound > size // 2
    capped = DecisionSettings(tokenizer={MODEL: path}, tokenize_max_bytes=size - 1)
    assert read(chat(CJK), capped, CHAT).facts == read(chat(CJK), DecisionSettings(), CHAT).facts


def test_a_tokenizer_that_does_not_load_is_refused_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "tokenizer.json"
    with pytest.raises(ConfigError, match=r"decision: tokenizer: .*tiny: .*nope.*not a tokenizer"):
        validate(DecisionSettings, {"tokenizer": {MODEL: str(missing)}}, "decision")


def test_with_a_tokenizer_bodies_are_tokenized_in_the_pool_from_8_kib(path: Path) -> None:
    """Tokenizing holds the GIL for ~0.6 ms a KiB: the event loop keeps to small bodies."""
    assert DecisionSettings().pool_from_bytes == 256 * 1024
    assert DecisionSettings(tokenizer={MODEL: path}).pool_from_bytes == 8 * 1024


async def test_the_pool_worker_counts_a_large_prompt_exactly(path: Path) -> None:
    """Counted off the event loop, in the body pool's worker, with the tokenizer it loaded."""
    decider = make_decider(tokenizer={MODEL: path})
    pool = BodyPool(decider, decider.settings.pool_from_bytes)
    try:
        await pool.start()
        pooled = await pool.read(chat(CJK), CHAT)
        assert pooled is not None  # 12 KiB: over the 8 KiB from which bodies go to the pool
        exact = tokens(path, f"<s>user: {CJK}</s>\n<s>assistant: ")
        assert pooled.facts.prompt_tokens == pooled.facts.prompt_bound == exact
    finally:
        await pool.close()
