"""Stored responses (the operator's option, `llmgw up --responses-store`) through the real stack,
as the OpenAI SDK calls them: a response kept on the pod that generated it, read again, continued
and cancelled there, and by its tenant alone."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import openai
import pytest

from extauthz.types import PerMinuteLimits
from tests.e2e.conftest import stack_settings
from tests.e2e.test_ledger_e2e import recorded
from tests.e2e.test_ratelimit_e2e import MODEL, add_tenant, reservations
from tests.e2e.test_responses_e2e import sdk
from tests.eventually import eventually
from tests.http import call
from tools.stack import Stack

TURNS = 6  # without the pinning, 6 turns all on one of 2 pods by chance: ~1 run in 32


@pytest.fixture(scope="module")
def store_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    state = tmp_path_factory.mktemp("stored")
    settings = stack_settings().model_copy(update={"responses_store": True, "pods": 2})
    with Stack(settings, state / "stack") as running:
        yield running


def test_a_conversation_continues_on_the_pod_that_holds_it_and_is_read_again(
    store_stack: Stack,
) -> None:
    """Each turn names the previous response: the pod that holds it serves the turn, prepending
    the conversation (the pod's prompt grows by it), and the ledger charges what the pod
    counted, the history included. Reading a response again costs nothing. Without the pinning
    the pick would scatter the turns over both pods, and a pod without the response answers 404."""
    stack = store_stack
    key = add_tenant(stack, "st-talk", "standard", PerMinuteLimits(tpm=1_000_000))
    ids: list[str] = []
    with sdk(stack, key) as client:
        raw = client.responses.with_raw_response.create(
            model=MODEL, input="tell me about the sea", max_output_tokens=8
        )
        first = raw.parse()
        ids.append(raw.headers["x-request-id"])
        previous, grown = first, first.usage
        for turn in range(TURNS):
            if turn % 2:  # a streamed turn is stored as well
                with client.responses.with_streaming_response.create(
                    model=MODEL,
                    input=f"and then {turn}?",
                    max_output_tokens=8,
                    previous_response_id=previous.id,
                    stream=True,
                ) as streamed:
                    ids.append(streamed.headers["x-request-id"])
                    events = list(streamed.parse())
                last = events[-1]
                assert last.type == "response.completed"
                reply = last.response
            else:
                raw = client.responses.with_raw_response.create(
                    model=MODEL,
                    input=f"and then {turn}?",
                    max_output_tokens=8,
                    previous_response_id=previous.id,
                )
                ids.append(raw.headers["x-request-id"])
                reply = raw.parse()
            assert reply.usage is not None and grown is not None
            assert reply.previous_response_id == previous.id
            # The history is the pod's: the previous prompt and output come first.
            assert reply.usage.input_tokens > grown.input_tokens + grown.output_tokens
            previous, grown = reply, reply.usage

        again = client.responses.with_raw_response.retrieve(previous.id)
        read = again.parse()
        assert read.id == previous.id and read.output_text == previous.output_text
        ids.append(again.headers["x-request-id"])

    rows = recorded(stack, set(ids))
    pods = {rows[i]["pod"] for i in ids}
    assert len(pods) == 1, pods  # every turn and the read at the pod that holds the conversation
    last_turn = rows[ids[-2]]
    assert grown is not None
    assert last_turn["prompt_tokens"] == grown.input_tokens
    assert last_turn["completion_tokens"] == grown.output_tokens
    read_row = rows[ids[-1]]
    assert read_row["endpoint"] == "/v1/responses/{id}" and read_row["charged_tokens"] == 0
    eventually(lambda: not reservations(stack, "st-talk"), 10.0, "every reservation settled")


def test_another_tenants_or_a_changed_response_id_is_not_found(store_stack: Stack) -> None:
    stack = store_stack
    owner = add_tenant(stack, "st-owner", "standard")
    other = add_tenant(stack, "st-other", "standard")
    with sdk(stack, owner) as client:
        kept = client.responses.create(model=MODEL, input="a secret", max_output_tokens=4)
    text = kept.id.removeprefix("resp_")
    raw = bytearray(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
    raw[20] ^= 1  # the pod's part: another pod, if it were believed
    changed = "resp_" + base64.urlsafe_b64encode(bytes(raw)).rstrip(b"=").decode()
    with sdk(stack, other) as client:
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(kept.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.cancel(kept.id)
        with pytest.raises(openai.NotFoundError) as refused:
            client.responses.create(model=MODEL, input="go on", previous_response_id=kept.id)
        assert refused.value.code == "response_not_found"
    with sdk(stack, owner) as client:
        for forged in (changed, kept.id + "A", "resp_0123456789"):
            with pytest.raises(openai.NotFoundError):
                client.responses.retrieve(forged)
        # The owner still reads it; a finished response is the pod's to refuse to cancel.
        assert client.responses.retrieve(kept.id).output_text == kept.output_text
        with pytest.raises(openai.BadRequestError) as cancelled:
            client.responses.cancel(kept.id)
        assert "synchronous" in cancelled.value.message
    with sdk(stack, "sk-stranger") as client, pytest.raises(openai.AuthenticationError):
        client.responses.retrieve(kept.id)


def test_a_response_not_stored_is_not_found_and_background_is_refused(store_stack: Stack) -> None:
    stack = store_stack
    key = add_tenant(stack, "st-nostore", "standard")
    with sdk(stack, key) as client:
        unkept = client.responses.create(model=MODEL, input="hi", max_output_tokens=4, store=False)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(unkept.id)
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model=MODEL, input="hi", background=True)
        assert refused.value.param == "background"


def test_a_stored_response_is_not_retried_on_a_pod_its_id_does_not_name(store_stack: Stack) -> None:
    """Pod 0 answers this tenant 503 (Envoy retries a 503 on another pod): a response that is
    stored is not retried, since its ID names the pod chosen for it, so the client gets the 503
    and every response it got is found again. Envoy retrying it would store it on pod 1 under
    an ID naming pod 0: found by nobody."""
    stack = store_stack
    key = add_tenant(stack, "st-retry", "standard")
    url = f"{stack.pod_url(0)}/admin/faults"
    fault = {"error_rate": 1.0, "error_status": 503, "error_tenants": ["st-retry"]}
    assert call("PUT", url, fault).status == 200
    refused, kept = 0, []
    try:
        with sdk(stack, key) as client:
            for _ in range(8):
                try:
                    kept.append(
                        client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
                    )
                except openai.APIStatusError as error:
                    assert error.status_code == 503
                    refused += 1
                    break  # one pod error: a second would open the tenant's circuit breaker
    finally:
        assert call("DELETE", url).status == 200
    assert refused >= 1  # the premise: pod 0 was chosen for at least one of them
    with sdk(stack, key) as client:  # read with pod 0 well again: where each ID leads
        for response in kept:
            assert client.responses.retrieve(response.id).id == response.id
