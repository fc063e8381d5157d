"""Prompts counted by the served model's tokenizer (llmgw/tokenizer.py), against the tiny model's
tokenizer made on the spot: the chat template applied as vLLM applies it, a changed file loaded
again, a broken one leaving the last good one in force."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from llmgw import tokenizer
from llmgw.facts import MESSAGE_TOKENS
from tests import tiny_tokenizer
from tests.tiny_tokenizer import tokens


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tiny_tokenizer.write(tmp_path / "tiny")


def test_a_chat_counts_the_rendered_template(path: Path) -> None:
    """vLLM renders the template (generation prompt added) and tokenizes it without adding
    special tokens: the template's own <s> and </s> are one token each."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好 🌍"}]
    rendered = "<s>system: Be brief.</s>\n<s>user: 你好 🌍</s>\n<s>assistant: "
    counted = tokenizer.counter(path).request({"messages": messages}, image_tokens=0)
    assert counted is not None and counted.tokens == tokens(path, rendered)
    # Its token IDs, as the pod's prefix-cache blocks hash them (llmgw/kvblocks.py).
    ids = tokenizer.counter(path).tokenizer.encode(rendered, add_special_tokens=False).ids
    assert counted.ids == tuple(ids)
    # Text parts are joined by a newline (vLLM's string content format); an image counts apart.
    parts = [{"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text", "text": "b"}]
    with_image = tokenizer.counter(path).request(
        {"messages": [{"role": "user", "content": parts}]}, image_tokens=500
    )
    assert with_image is not None
    assert with_image.tokens == tokens(path, "<s>user: a\nb</s>\n<s>assistant: ") + 500
    assert with_image.ids == ()  # the image's tokens sit among them: not the pod's IDs


def test_completions_count_each_prompt_and_token_ids_themselves(path: Path) -> None:
    counter = tokenizer.counter(path)
    one = counter.request({"prompt": "日本語"}, 0)
    assert one is not None and one.tokens == tokens(path, "日本語") == 9
    assert one.ids == tuple(counter.tokenizer.encode("日本語").ids)
    assert counter.request({"prompt": ["ab", "😀"]}, 0) == tokenizer.Prompt(tokens(path, "ab") + 4)
    assert counter.request({"prompt": [[1, 2, 3], [4]]}, 0) == tokenizer.Prompt(4)
    assert counter.request({"prompt": [1, 2, 3]}, 0) == tokenizer.Prompt(3, (1, 2, 3))


def test_without_a_template_a_message_counts_its_text_and_the_overhead(path: Path) -> None:
    (path.parent / "chat_template.jinja").unlink()
    messages = [{"role": "user", "content": "🌍" * 10}]
    counted = tokenizer.counter(path).request({"messages": messages}, 0)
    assert counted == tokenizer.Prompt(2 * MESSAGE_TOKENS + tokens(path, "user") + 40)
    # An upper bound of what the template renders (5 tokens a message, 12 for the header).
    assert counted.tokens >= tokens(path, "<s>user: " + "🌍" * 10 + "</s>\n<s>assistant: ")


def test_a_prompt_the_pod_refuses_before_counting_is_no_count(path: Path) -> None:
    """A lone surrogate (JSON allows "\ud800"; UTF-8 does not), a template's refusal: the
    caller estimates instead."""
    assert tokenizer.counter(path).request({"prompt": "a\ud800"}, 0) is None
    surrogate = {"messages": [{"role": "user", "content": "\ud800"}]}
    assert tokenizer.counter(path).request(surrogate, 0) is None
    (path.parent / "chat_template.jinja").write_text("{{ raise_exception('no system role') }}")
    assert tokenizer.counter(path).request({"messages": [{"role": "user"}]}, 0) is None


def test_a_changed_tokenizer_is_loaded_again_and_a_broken_one_keeps_the_last_good(
    path: Path, tmp_path: Path
) -> None:
    before = tokenizer.counter(path)
    (path.parent / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    after = tokenizer.counter(path)
    assert after is not before
    counted = after.request({"messages": [{"role": "u", "content": "x"}]}, 0)
    assert counted is not None and counted.tokens == 1
    path.write_text("not json")
    assert tokenizer.counter(path) is after
    with pytest.raises(tokenizer.TokenizerError, match=r"not a tokenizer\.json"):
        tokenizer.load(path)
    fresh = tmp_path / "never" / "tokenizer.json"
    fresh.parent.mkdir()
    fresh.write_text("{}")
    with pytest.raises(tokenizer.TokenizerError):
        tokenizer.counter(fresh)  # none ever loaded: nothing to keep


def test_named_templates_in_the_config_are_read_as_transformers_reads_them(path: Path) -> None:
    shutil.move(path.parent / "chat_template.jinja", path.parent / "unused.jinja")
    named = [
        {"name": "tool_use", "template": "{{ raise_exception('not this one') }}"},
        {"name": "default", "template": "{{ bos_token }}{{ messages[0]['content'] }}"},
    ]
    config = {"bos_token": {"content": "<s>"}, "chat_template": named}
    (path.parent / "tokenizer_config.json").write_text(json.dumps(config))
    counted = tokenizer.load(path).request({"messages": [{"content": "ab"}]}, 0)
    assert counted is not None and counted.tokens == 1 + tokens(path, "ab")
