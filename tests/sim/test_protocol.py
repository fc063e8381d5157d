"""Request parsing: priority from the body or the X-Vllm-Priority header, jobs per choice."""

from __future__ import annotations

import pytest

from sim.errors import ApiError
from sim.protocol import parse
from sim.types import SimSettings

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
