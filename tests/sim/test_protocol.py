"""Request parsing: priority from the body or the X-Vllm-Priority header, jobs per choice."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.errors import ApiError
from sim.protocol import parse
from sim.types import SimSettings
from tests import tiny_tokenizer
from tests.tiny_tokenizer import tokens

SETTINGS = SimSettings()


def priorities(body: dict[str, object], header: str | None = None) -> list[int]:
    return [job.priority for job in parse("completion", body, SETTINGS, header).jobs]


def test_priority_defaults_to_0_and_the_header_overrides_the_body() -> None:
    assert priorities({"prompt": "x"}) == [0]
    assert priorities({"prompt": "x", "priority": 4}) == [4]
    assert priorities({"prompt": "x", "priority": 4}, "-2") == [-2]
    assert priorities({"prompt": "x", "priority": 4}, "soon") == [4]  # unreadable: ignored
    assert priorities({"prompt": "x", "n": 2, "priority": 1}) == [1, 1]


@pytest.mark.parametrize("bad", ["high", 1.5, [1], 2**63])
def test_priority_must_be_an_int64(bad: object) -> None:
    with pytest.raises(ApiError) as caught:
        parse("chat", {"messages": [{"role": "user"}], "priority": bad}, SETTINGS, None)
    assert (caught.value.status, caught.value.param) == (400, "body.priority")


def test_samples_differ_and_list_prompts_are_prompt_major() -> None:
    request = parse("completion", {"prompt": ["a" * 8, "b" * 8], "n": 2}, SETTINGS, None)
    assert [(j.prompt, j.sample) for j in request.jobs] == [
        ("a" * 8, 0), ("a" * 8, 1), ("b" * 8, 0), ("b" * 8, 1)]  # fmt: skip
    assert request.prompt_tokens == 4


def test_with_the_model_tokenizer_prompts_count_as_its_pods_count_them(tmp_path: Path) -> None:
    path = tiny_tokenizer.write(tmp_path / "tiny")
    settings = SimSettings(tokenizer=path)
    chat = {"messages": [{"role": "user", "content": "你好" * 100}]}
    rendered = "<s>user: " + "你好" * 100 + "</s>\n<s>assistant: "
    assert parse("chat", chat, settings, None).prompt_tokens == tokens(path, rendered) > 600
    assert parse("chat", chat, SETTINGS, None).prompt_tokens < 100  # 4 characters a token
    completion = parse("completion", {"prompt": ["🌍" * 10, "ab"]}, settings, None)
    assert completion.prompt_tokens == 40 + tokens(path, "ab")
    with pytest.raises(ApiError, match="at least 601 input tokens"):  # truncated at 601
        parse("chat", chat, SimSettings(tokenizer=path, max_model_len=600), None)
