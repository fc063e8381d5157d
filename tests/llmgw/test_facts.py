"""The request-facts contract: extauthz writes it into metadata, Envoy carries it as a protobuf
Struct, the router and the ledger read it back — the same facts on every side."""

from __future__ import annotations

import json
from typing import Any

import pytest
from google.protobuf import struct_pb2
from google.protobuf.json_format import MessageToDict
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from llmgw import facts

SAMPLE = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "You are terse. " * 40},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]},
    ],
    "stream": True,
    "stream_options": {"include_usage": True},
    "n": 3,
    "max_tokens": 100,
}


def through_envoy(meta: dict[str, Any]) -> dict[str, Any]:
    """What a reader gets: the values after a protobuf Struct round trip (numbers as doubles)."""
    s = struct_pb2.Struct()
    s.update(meta)
    return MessageToDict(struct_pb2.Struct.FromString(s.SerializeToString()))


def parse(body: dict[str, Any], max_output: int = 256) -> facts.RequestFacts:
    return facts.from_body(
        body, chars_per_token=4, image_tokens=1000, max_output=max_output, max_blocks=64, model="m"
    )


def test_facts_survive_the_trip_through_envoy() -> None:
    written = parse(SAMPLE)
    assert (written.stream, written.include_usage, written.n, written.max_output) == (
        True,
        True,
        3,
        100,
    )
    # Text and roles / 4 ("system" + "user": 10 chars), one image, the template's tokens.
    assert written.prompt_tokens == (600 + 2 + 10) // 4 + 1000 + 3 * facts.MESSAGE_TOKENS
    assert written.token_estimate == written.prompt_tokens + 300  # every choice's cap
    assert len(written.prefix_blocks) >= 9  # 64-bit hashes, which doubles could not carry
    assert facts.RequestFacts.from_metadata(through_envoy(written.to_metadata())) == written


@pytest.mark.parametrize(
    ("body", "cap"),
    [
        ({"messages": []}, 256),  # the OpenAI SDK's default: the gateway's cap
        ({"messages": [], "max_tokens": None, "max_completion_tokens": None}, 256),
        ({"messages": [], "max_tokens": 10**20}, 256),  # lowered to the gateway's cap
        ({"messages": [], "max_tokens": 10}, 10),
        # chat: vLLM reads max_completion_tokens first; a value it would refuse counts as none
        ({"messages": [], "max_completion_tokens": 5, "max_tokens": 99}, 5),
        ({"messages": [], "max_completion_tokens": -1, "max_tokens": 99}, 99),
        ({"messages": [], "max_tokens": "nan"}, 256),
        ({"messages": [], "max_tokens": -1}, 256),
        ({"messages": [], "max_tokens": 2.5}, 256),
        ({"messages": [], "max_tokens": 0}, 0),  # the pod refuses it, as it would without us
        # completions: no max_tokens is vLLM's (and OpenAI's) 16, null leaves it open
        ({"prompt": "hi"}, facts.COMPLETIONS_DEFAULT_OUTPUT),
        ({"prompt": "hi", "max_tokens": None}, 256),
        ({"prompt": "hi", "max_completion_tokens": 5}, facts.COMPLETIONS_DEFAULT_OUTPUT),
    ],
)
def test_the_output_cap_is_the_clients_within_the_gateways(body: dict[str, Any], cap: int) -> None:
    assert parse(body).max_output == cap
    # A bound known later (the tenant's) lowers it exactly as if it had been known at first.
    assert min(parse(body, facts.MAX_OUTPUT_TOKENS).max_output, 256) == cap


def test_hostile_numbers_reach_redis_clamped() -> None:
    huge = parse(
        {"prompt": [[1]] * 10_000, "max_tokens": 1e20, "n": 10**30, "best_of": "-1"},
        max_output=facts.MAX_OUTPUT_TOKENS,
    )
    assert (huge.max_output, huge.n) == (facts.MAX_OUTPUT_TOKENS, facts.MAX_CHOICES * 10_000)
    assert huge.token_estimate == facts.MAX_RESERVATION  # above any limit, still a plain integer
    assert huge.to_metadata()["token_estimate"] == str(10**15)
    assert parse({"messages": [], "n": "nan", "best_of": float("inf")}).n == 1
    assert parse({"messages": [], "n": []}) == parse({"messages": []})
    # Past 4,300 characters a number in a string reads as more than any clamp: the pod would
    # read these zeros away, and the reservation must not come out lower than its count.
    padded = parse({"messages": [], "n": "0" * 5000 + "2", "max_tokens": "0" * 5000 + "9"})
    assert (padded.n, padded.max_output) == (facts.MAX_CHOICES, 256)


pydantic_int = TypeAdapter(int)
numbers = st.one_of(
    st.integers(-(10**6), 10**30),
    st.floats(allow_nan=True),
    st.booleans(),
    st.text(alphabet="0123456789_.+- e", max_size=8),
    st.none(),
)


@settings(max_examples=500, deadline=None)
@given(numbers)
def test_numbers_are_read_as_the_pod_reads_them(value: object) -> None:
    """vLLM reads `n` and the caps with pydantic's lax int: whatever it accepts, the gateway
    reads alike (so a choice count like "12.0" cannot hide from the reservation)."""
    try:
        pod = pydantic_int.validate_python(value)
    except ValidationError:
        return  # the pod refuses the request: nothing is generated
    assert parse({"prompt": "p", "n": value}).n == min(max(pod, 1), facts.MAX_CHOICES)
    if pod >= 0:
        assert parse({"messages": [], "max_tokens": value}).max_output == min(pod, 256)


def test_values_are_read_the_way_the_pod_reads_them() -> None:
    """vLLM validates in pydantic's lax mode: a client must not get a stream (or a cap, or
    several choices) that the gateway does not know about."""
    lax = parse(
        {"messages": [], "stream": "true", "stream_options": {"include_usage": 1},
         "max_tokens": 250.0, "n": "3.0"}
    )  # fmt: skip
    assert (lax.stream, lax.include_usage, lax.max_output, lax.n) == (True, True, 250, 3)
    assert not parse({"messages": [], "stream": "no"}).stream
    assert parse({"messages": [], "max_tokens": "12"}).max_output == 12
    assert parse({"messages": [], "max_tokens": " 1_2.0 "}).max_output == 12


def test_a_batch_of_prompts_reserves_for_every_prompt() -> None:
    batch = parse({"prompt": ["a" * 400] * 5, "max_tokens": 10, "n": 2})
    assert (batch.n, batch.prompt_tokens, batch.token_estimate) == (10, 500, 600)
    ids = parse({"prompt": [[7] * 600, [8] * 400], "max_tokens": 1})
    assert (ids.prompt_tokens, ids.n) == (1000, 2)
    assert parse({"prompt": [7] * 300}).prompt_tokens == 300  # one token-ID prompt
    best = parse({"messages": [], "n": 2, "best_of": "5"})
    assert best.n == 5 and best.token_estimate == facts.MESSAGE_TOKENS + 5 * 256


def test_roles_and_the_template_count_in_the_prompt() -> None:
    """Left out, 300 empty messages reserved 1 token and the pod counted ~3,900; a 4,000-char
    role none at all."""
    empty = parse({"messages": [{"role": "user", "content": ""}] * 300, "max_tokens": 1})
    assert empty.prompt_tokens >= 300 * 13  # what the simulator's template renders them to
    long_role = parse({"messages": [{"role": "r" * 4000, "content": "hi"}], "max_tokens": 1})
    assert long_role.prompt_tokens >= 1000


def test_images_tools_and_tool_calls_count_in_the_prompt() -> None:
    """The chat template renders tool definitions and calls into the prompt; images take
    tokens too. Left out, an agent's request with 40 tools reserved a few tokens."""
    tools = [
        {"type": "function", "function": {"name": f"tool_{i}", "parameters": {"type": "object",
         "properties": {"city": {"type": "string", "description": "x" * 200}}}}}
        for i in range(40)
    ]  # fmt: skip
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "y" * 400}}
    picture = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 4000}}
    base = {"messages": [{"role": "user", "content": "hi"}]}
    # "hi" and its role "user" / 4, and the template's tokens around one message.
    assert parse(base).prompt_tokens == 2 + 2 * facts.MESSAGE_TOKENS
    with_tools = parse({**base, "tools": tools}).prompt_tokens
    assert with_tools >= 1 + len(json.dumps(tools)) // 4
    legacy = parse({**base, "functions": [t["function"] for t in tools]}).prompt_tokens
    assert legacy > 40 * 200 // 4
    called = {"messages": [{"role": "assistant", "content": None, "tool_calls": [call]}]}
    assert parse(called).prompt_tokens > 100
    images = {"messages": [{"role": "user", "content": [picture, picture, {"type": "text",
              "text": "what differs?"}]}]}  # fmt: skip
    # Per image, not its URL's length.
    assert parse(images).prompt_tokens == 2 * 1000 + 5 + 2 * facts.MESSAGE_TOKENS


def test_missing_or_mistyped_metadata_reads_as_defaults() -> None:
    assert facts.RequestFacts.from_metadata({}) == facts.RequestFacts()
    odd = {"n": "x", "max_output": -4, "prefix_blocks": "zz", "stream": "true", "model": 3}
    assert facts.RequestFacts.from_metadata(odd) == facts.RequestFacts()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
bodies = st.dictionaries(
    st.sampled_from(
        ["model", "messages", "prompt", "input", "stream", "stream_options", "n", "best_of",
         "max_tokens", "max_completion_tokens", "tools", "functions"]
    ),
    json_values,
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(bodies)
def test_any_json_body_gives_facts_that_round_trip(body: dict[str, Any]) -> None:
    written = parse(json.loads(json.dumps(body)))
    assert written.token_estimate >= 0
    assert facts.RequestFacts.from_metadata(through_envoy(written.to_metadata())) == written


def test_prefix_hashes_are_per_cache_group() -> None:
    """The router's prefix map follows the pods' caches, which only share within a group."""
    text = "a shared system prompt " * 20
    mine = facts.block_hashes(text, 64, "tenant/a")
    assert mine == facts.block_hashes(text, 64, "tenant/a")
    assert set(mine).isdisjoint(facts.block_hashes(text, 64, "tenant/b"))


def test_documents_and_chat_template_arguments_count_in_the_bound() -> None:
    """vLLM hands both to the chat template, which renders them into the prompt: a prompt
    priced or reserved at its bound covers them."""
    messages = [{"role": "user", "content": "hi"}]
    plain = facts.prompt_size({"messages": messages}, 4.0, 0)
    document = {"title": "t", "text": "x" * 10_000}
    with_documents = facts.prompt_size({"messages": messages, "documents": [document]}, 4.0, 0)
    kwargs = {"custom_tools": [{"name": "f", "description": "y" * 5_000}]}
    with_kwargs = facts.prompt_size({"messages": messages, "chat_template_kwargs": kwargs}, 4.0, 0)
    assert with_documents.bound >= plain.bound + 10_000
    assert with_kwargs.bound >= plain.bound + 5_000
