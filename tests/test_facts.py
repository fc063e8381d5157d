"""The request-facts contract: extauthz writes it into metadata, Envoy carries it as a protobuf
Struct, the router and the ledger read it back — the same facts on every side."""

from __future__ import annotations

import json
from typing import Any

from google.protobuf import struct_pb2
from google.protobuf.json_format import MessageToDict
from hypothesis import given, settings
from hypothesis import strategies as st

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


def parse(body: dict[str, Any]) -> facts.RequestFacts:
    return facts.from_body(body, chars_per_token=4, default_output=256, max_blocks=64, model="m")


def test_facts_survive_the_trip_through_envoy() -> None:
    written = parse(SAMPLE)
    assert (written.stream, written.include_usage, written.n, written.max_output) == (
        True,
        True,
        3,
        100,
    )
    assert written.token_estimate == written.prompt_tokens + 300  # every choice's cap
    assert len(written.prefix_blocks) >= 9  # 64-bit hashes, which doubles could not carry
    assert facts.RequestFacts.from_metadata(through_envoy(written.to_metadata())) == written


def test_no_max_tokens_reserves_the_default_cap_and_absurd_numbers_are_clamped() -> None:
    assert parse({"messages": []}).max_output == 256
    huge = parse({"messages": [], "max_tokens": 10**20, "n": 10**9, "best_of": -1})
    assert (huge.max_output, huge.n) == (facts.MAX_OUTPUT_TOKENS, facts.MAX_CHOICES)
    assert parse({"messages": [], "max_tokens": True, "n": []}) == parse({"messages": []})


def test_values_are_read_the_way_the_pod_reads_them() -> None:
    """vLLM validates in pydantic's lax mode: a client must not get a stream (or a cap, or
    several choices) that the gateway does not know about."""
    lax = parse(
        {"messages": [], "stream": "true", "stream_options": {"include_usage": 1},
         "max_tokens": 2500.0, "n": "3"}
    )  # fmt: skip
    assert (lax.stream, lax.include_usage, lax.max_output, lax.n) == (True, True, 2500, 3)
    assert not parse({"messages": [], "stream": "no"}).stream
    assert parse({"messages": [], "max_tokens": "12"}).max_output == 12
    assert parse({"messages": [], "max_tokens": 2.5}).max_output == 256  # the pod refuses it


def test_a_batch_of_prompts_reserves_for_every_prompt() -> None:
    batch = parse({"prompt": ["a" * 400] * 5, "max_tokens": 10, "n": 2})
    assert (batch.n, batch.prompt_tokens, batch.token_estimate) == (10, 500, 600)
    ids = parse({"prompt": [[7] * 600, [8] * 400], "max_tokens": 1})
    assert (ids.prompt_tokens, ids.n) == (1000, 2)


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
         "max_tokens", "max_completion_tokens"]
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
