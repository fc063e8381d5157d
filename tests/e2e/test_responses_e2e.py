"""The Responses API through the real stack, as the OpenAI SDK calls it: checked, reserved,
capped, routed, metered and settled as chat is; recorded under its own endpoint.

Stateless: what would need a stored response is refused (the gateway keeps none)."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from urllib.parse import urlsplit

import openai
import pytest

from extauthz.types import PerMinuteLimits
from llmgw import wire
from tests.e2e.conftest import stack_settings
from tests.e2e.test_ledger_e2e import recorded
from tests.e2e.test_ratelimit_e2e import MODEL, add_tenant, auth, reservations
from tests.eventually import eventually
from tools.stack import Stack

# A hard budget small enough that what is left lowers a request's cap.
TIERS = """
tiers:
  standard: {requests: {second: 1000}, tokens: {minute: 1000000}}
  budgeted: {requests: {second: 1000}, tokens: {minute: 1000000}, budget: {tokens: 400, per: day}}
"""


@pytest.fixture(scope="module")
def responses_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    state = tmp_path_factory.mktemp("responses")
    (state / "tiers.yaml").write_text(TIERS)
    settings = stack_settings().model_copy(update={"tiers_file": state / "tiers.yaml"})
    with Stack(settings, state / "stack") as running:
        yield running


def sdk(stack: Stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=key, max_retries=0)


def test_the_sdks_responses_create_is_served_metered_and_recorded(
    responses_stack: Stack,
) -> None:
    stack = responses_stack
    key = add_tenant(stack, "rs-sdk", "standard", PerMinuteLimits(tpm=100_000))
    with sdk(stack, key) as client:
        raw = client.responses.with_raw_response.create(
            model=MODEL, input="tell me about the sea", instructions="be brief", max_output_tokens=9
        )
        whole = raw.parse()
        assert whole.output_text and whole.usage is not None
        assert 1 <= whole.usage.output_tokens <= 9 and whole.usage.input_tokens > 0
        # OpenAI's rate-limit headers, as on chat: the reservation (prompt + the cap) is held.
        assert int(raw.headers["x-ratelimit-limit-tokens"]) == 100_000
        assert int(raw.headers["x-ratelimit-remaining-tokens"]) < 100_000
        assert raw.headers[wire.HEADER_SESSION]

        events = list(
            client.responses.create(model=MODEL, input="a story", max_output_tokens=12, stream=True)
        )
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    completed = events[-1]
    assert completed.type == "response.completed" and completed.response.usage is not None
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    streamed = completed.response.usage
    assert "".join(d.delta for d in deltas) == completed.response.output_text
    assert 1 <= streamed.output_tokens <= 12

    stream_id = completed.response.id
    rows = recorded(stack, {raw.headers["x-request-id"]})
    row = rows[raw.headers["x-request-id"]]
    assert row["endpoint"] == wire.RESPONSES_PATH and row["outcome"] == "ok"
    assert (row["prompt_tokens"], row["completion_tokens"]) == (
        whole.usage.input_tokens,
        whole.usage.output_tokens,
    )
    assert row["charged_tokens"] == whole.usage.total_tokens
    # The stream's record: its usage from the `response.completed` event.
    streamed_rows = recorded(stack, {stream_id})
    srow = streamed_rows[stream_id]
    assert srow["stream"] is True and srow["endpoint"] == wire.RESPONSES_PATH
    assert (srow["prompt_tokens"], srow["completion_tokens"]) == (
        streamed.input_tokens,
        streamed.output_tokens,
    )
    eventually(lambda: not reservations(stack, "rs-sdk"), 10.0, "the reservations settled")


def test_a_responses_stream_cut_short_is_charged_what_was_streamed(
    responses_stack: Stack,
) -> None:
    stack = responses_stack
    key = add_tenant(stack, "rs-abort", "standard", PerMinuteLimits(tpm=100_000))
    url = urlsplit(stack.base_url)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=30)
    body = {
        "model": MODEL,
        "input": "a long story",
        "max_output_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {**auth(key), "content-type": "application/json"}
    conn.request("POST", f"{url.path}/responses", json.dumps(body), headers)
    reply = conn.getresponse()
    assert reply.status == 200
    request_id = reply.headers["x-request-id"]
    seen = 0
    while seen < 12:
        line = reply.readline()
        assert line, "the stream ended before the client hung up"
        seen += line == b"event: response.output_text.delta\n"
    conn.sock.close()  # type: ignore[union-attr]
    conn.close()
    row = recorded(stack, {request_id})[request_id]
    assert row["outcome"] == "aborted" and row["stream"] is True
    # Every delta that reached the client is charged (Envoy may have relayed a few more than
    # the client read before it noticed); the pod stopped long before 2000.
    assert seen <= row["completion_tokens"] < 2000
    assert row["prompt_tokens"] > 0
    assert row["charged_tokens"] == row["prompt_tokens"] + row["completion_tokens"]
    eventually(lambda: not reservations(stack, "rs-abort"), 10.0, "the reservation settled")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"store": True}, "store"),
        ({"background": True}, "background"),
        ({"previous_response_id": "resp_0123"}, "previous_response_id"),
    ],
)
def test_what_needs_a_stored_response_is_refused_clearly(
    responses_stack: Stack, fields: dict[str, object], param: str
) -> None:
    key = add_tenant(responses_stack, f"rs-{param}", "standard")
    with sdk(responses_stack, key) as client, pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="hi", **fields)  # type: ignore[call-overload]
    error = refused.value
    assert error.code == "unsupported_parameter" and error.param == param
    assert "keeps no responses" in error.message


def test_a_budget_lowers_the_cap_the_pod_gets_as_max_output_tokens(
    responses_stack: Stack,
) -> None:
    """What the hard budget has left, not the client's 2,000: the cap Envoy appends under the
    Responses API's name, which the pod obeys (its reply says so)."""
    key = add_tenant(responses_stack, "rs-budget", "budgeted")
    with sdk(responses_stack, key) as client:
        capped = client.responses.create(
            model=MODEL,
            input="a long story",
            max_output_tokens=2000,
            extra_body={"ignore_eos": True},
        )
    assert capped.usage is not None and capped.max_output_tokens is not None
    assert capped.usage.output_tokens == capped.max_output_tokens < 400
    assert capped.status == "incomplete"


def test_a_completed_event_larger_than_envoys_default_still_gives_its_usage(
    responses_stack: Stack,
) -> None:
    """`response.completed` echoes the whole response (instructions, output): 240 KB here, far
    past the 8 KiB Envoy's SSE parser keeps of an event by default. Its usage is read all the
    same, not the whole reservation charged."""
    stack = responses_stack
    key = add_tenant(stack, "rs-large", "standard")
    with sdk(stack, key) as client:
        events = list(
            client.responses.create(
                model=MODEL, instructions="be thorough " * 20_000, input="go",
                max_output_tokens=500, stream=True,
            )
        )  # fmt: skip
    done = events[-1]
    assert done.type == "response.completed" and done.response.usage is not None
    used = done.response.usage
    assert used.output_tokens < 500  # stopped by itself: the reservation's cap was not used
    row = recorded(stack, {done.response.id})[done.response.id]
    assert (row["prompt_tokens"], row["completion_tokens"]) == (
        used.input_tokens,
        used.output_tokens,
    )
