"""The gateway in front of a real vLLM pod: the CPU build serving the tiny model, through real
Envoy and every service, with the OpenAI SDK and raw HTTP. One pod, `--max-num-seqs 1`: one
sequence runs at a time, so the scheduler's choices are observable from outside.

What the pod counts itself (`vllm:` counters on its /metrics) is the reference: the ledger's
usage, the prefix cache hits, the requests running.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam

from llmgw import wire
from llmgw.fleetload import FleetLoad
from tests.e2e.conftest import api_key
from tests.e2e.realpods import MARKS, model, pod_metrics, real_stack, sdk
from tests.e2e.test_isolation import add_tenants
from tests.e2e.test_ledger_e2e import recorded
from tests.eventually import eventually
from tests.http import call
from tools.engine import BLOCK_SIZE
from tools.stack import Stack

pytestmark = MARKS

NO_EOS = {"ignore_eos": True}  # vLLM's: the tiny model's answers last exactly max_tokens
PROMPT, GENERATED = "vllm:prompt_tokens_total", "vllm:generation_tokens_total"
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    state = tmp_path_factory.mktemp("vllm") / "stack"
    # With the pods' store of responses: vLLM's own, for the stored responses' test.
    with real_stack(
        state, pods=1, vllm_args=("--max-num-seqs", "1"), responses_store=True
    ) as stack:
        yield stack


def user(text: str) -> list[ChatCompletionMessageParam]:
    return [{"role": "user", "content": text}]


HI = user("Hello, how are you today?")


def noise(seed: str, chars: int) -> str:
    """Text the tiny tokenizer never learned (about a token a character), the same every run."""
    text = ""
    while len(text) < chars:
        seed = hashlib.sha256(seed.encode()).hexdigest()
        text += seed
    return text[:chars]


@contextmanager
def streaming(stack: Stack, key: str, max_tokens: int) -> Iterator[http.client.HTTPResponse]:
    """A stream through the gateway that never stops by itself (vLLM's ignore_eos), its headers
    read; leaving the block hangs up, finished or not. A check shed on a busy machine (503
    `overloaded`, the gateway's answer to overload, not what these tests look at) is sent again
    after its retry-after, at most five times."""
    body = {"model": model(stack), "messages": HI, "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}  # fmt: skip
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    for attempt in range(5):
        conn = http.client.HTTPConnection(stack.listen.host, stack.listen.port, timeout=120)
        try:
            conn.request("POST", "/v1/chat/completions", json.dumps(body), headers)
            reply = conn.getresponse()
            if reply.status == 503 and b'"overloaded"' in (text := reply.read()) and attempt < 4:
                time.sleep(float(reply.headers.get("retry-after", "1")))
                continue
            assert reply.status == 200, text if reply.status == 503 else reply.read()
            yield reply
            return
        finally:
            conn.close()


def events(reply: http.client.HTTPResponse) -> Iterator[dict[str, Any]]:
    """The stream's JSON events as they arrive."""
    while line := reply.readline():
        if line.startswith(b"data: {"):
            yield json.loads(line[len(b"data: ") :])


def has_token(event: dict[str, Any]) -> bool:
    """An event with output: a choice past the first (its role). One token or more (a slow reader
    gets them merged), decoded or not yet (part of a character)."""
    return any("role" not in c.get("delta", {}) for c in event.get("choices", []))


def finish(chunks: list[ChatCompletionChunk]) -> str | None:
    """The stream's finish reason: its last choice's. (Not a count of chunks: vLLM merges the
    tokens a slow reader has not taken yet into one chunk.)"""
    return [c.choices[0].finish_reason for c in chunks if c.choices][-1]


def settled(stack: Stack, request_id: str, before: dict[str, float]) -> dict[str, Any]:
    """The ledger's record of the request, once the pod's counters show it as well."""
    row: dict[str, Any] = recorded(stack, {request_id})[request_id]

    def counted() -> tuple[float, float]:
        now = pod_metrics(stack)
        return now[PROMPT] - before[PROMPT], now[GENERATED] - before[GENERATED]

    ledger = (row["prompt_tokens"], row["completion_tokens"])
    eventually(lambda: counted() == ledger, 30, lambda: f"pod {counted()}, ledger {ledger}")
    return row


def test_the_client_sees_usage_only_when_it_asked(real: Stack) -> None:
    """vLLM runs with --enable-force-include-usage (usage on every chunk of every stream, for
    the ledger); the gateway strips it from the streams of clients that did not ask."""
    with sdk(real, api_key(real, "standard")) as client:
        chat = client.chat.completions
        whole = chat.create(model=model(real), messages=HI, max_tokens=8, extra_body=NO_EOS)
        plain = list(
            chat.create(
                model=model(real), messages=HI, max_tokens=8, extra_body=NO_EOS, stream=True
            )
        )
        asked = list(
            chat.create(
                model=model(real), messages=HI, max_tokens=8, extra_body=NO_EOS, stream=True,
                stream_options={"include_usage": True},
            )
        )  # fmt: skip
    assert whole.usage is not None and whole.usage.completion_tokens == 8
    assert finish(plain) == "length"
    assert all(c.usage is None for c in plain)
    assert finish(asked) == "length"
    last = asked[-1]  # OpenAI's usage chunk: no choice, the whole usage
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
        whole.usage.prompt_tokens,
        8,
    )
    # The same over raw HTTP: not a byte of usage unless asked, and the stream ends as OpenAI's.
    url, auth = f"{real.base_url}/chat/completions", {"authorization": f"Bearer {api_key(real)}"}
    body = {"model": model(real), "messages": HI, "max_tokens": 8, "stream": True}
    for include in (False, True):
        raw = call("POST", url, {**body, "stream_options": {"include_usage": include}}, auth)
        assert raw.status == 200 and raw.headers["content-type"].startswith("text/event-stream")
        text = raw.body.decode()
        assert ('"usage"' in text) is include
        assert text.endswith("data: [DONE]\n\n")


def test_the_ledger_charges_what_the_pod_counted(real: Stack) -> None:
    """Each request's prompt and completion tokens in the ledger are the pod's own counts (its
    counters' increase), whether the client asked for usage or not."""
    with sdk(real, api_key(real, "standard")) as client:
        chat = client.chat.completions.with_raw_response
        before = pod_metrics(real)
        whole = chat.create(model=model(real), messages=HI, max_tokens=12, extra_body=NO_EOS)
        row = settled(real, whole.headers["x-request-id"], before)
        usage = whole.parse().usage
        assert usage is not None
        assert (row["prompt_tokens"], row["completion_tokens"]) == (usage.prompt_tokens, 12)
        for include in (False, True):
            before = pod_metrics(real)
            stream = chat.create(
                model=model(real), messages=user(noise(f"ledger {include}", 100)), max_tokens=12,
                extra_body=NO_EOS, stream=True, stream_options={"include_usage": include},
            )  # fmt: skip
            chunks = list(stream.parse())
            row = settled(real, stream.headers["x-request-id"], before)
            # Not the outcome: the sync SDK hangs up at `[DONE]`, maybe before the pod's last
            # chunk reaches Envoy, which then logs the stream as aborted (charged the same).
            assert row["completion_tokens"] == 12
            assert row["prompt_tokens"] > 100  # the pod's tokenizer, not an estimate of ours
            assert row["charged_tokens"] == row["prompt_tokens"] + 12
            if include:
                assert chunks[-1].usage is not None
                assert chunks[-1].usage.prompt_tokens == row["prompt_tokens"]


def test_an_sdk_default_request_is_served(real: Stack) -> None:
    """No max_tokens, as the SDK sends by default: the gateway names the tier's output cap
    (4096), within the pod's context (1024) as the pod publishes it, which vLLM then fits beside
    the prompt; the tier's cap alone was vLLM's 400. Streamed: an answer that runs to the
    context took a busy machine longer than the stack lets a whole reply be silent (504)."""
    with sdk(real, api_key(real, "standard")) as client:
        chunks = list(client.chat.completions.create(model=model(real), messages=HI, stream=True))
    assert finish(chunks) in ("stop", "length")


def test_a_prompt_longer_than_the_context_is_vllms_400(real: Stack) -> None:
    messages = user(noise("too long", 3000))
    key = api_key(real, "standard")
    with sdk(real, key) as client, pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model(real), messages=messages, max_tokens=8)
    assert caught.value.status_code == 400
    body = {"model": model(real), "messages": messages, "max_tokens": 8}
    url, auth = f"{real.base_url}/chat/completions", {"authorization": f"Bearer {key}"}
    reply = call("POST", url, body, auth)
    assert reply.status == 400
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}  # OpenAI's error shape
    assert error["type"] == "BadRequestError" and error["code"] == 400
    context = real.settings.vllm.max_model_len
    assert f"maximum context length is {context} tokens" in error["message"]  # vLLM's words


def eventually_waiting(stack: Stack, count: int) -> None:
    what = lambda: f"not {count} waiting: {pod_metrics(stack)}"  # noqa: E731
    eventually(lambda: pod_metrics(stack)[WAITING] == count, 60, what, every_s=0.02)


def test_the_higher_priority_tenant_gets_its_first_token_first(real: Stack) -> None:
    """One long stream runs; a free tenant's request queues behind it, then a platinum one's.
    When the pod is free again its priority scheduler takes platinum first (fcfs, or a priority
    that did not reach the pod, would take the free one: it came first)."""
    first: list[str] = []

    # Each runs ~1 s alone (256 tokens), so the other's first token comes that long after its
    # own: the order the client's threads see is the pod's, however late a busy machine wakes
    # them (with 16 tokens, ~0.1 s apart, a CI run saw the reverse order).
    def queued(tier: str) -> None:
        with streaming(real, api_key(real, tier), max_tokens=256) as reply:
            chunks = events(reply)
            next(e for e in chunks if has_token(e))
            first.append(tier)
            for _ in chunks:  # to the end: a whole answer, not an abort
                pass

    # The premise (both queued while the blocker runs) is the machine's: the blocker's ~4 s of
    # generation can end before a busy machine queues the second request (three times running
    # in a pair run of two-worker suites). Then the scenario is run again, at most eight times;
    # the order is asserted only where the premise held.
    for _ in range(8):
        first.clear()
        threads = [threading.Thread(target=queued, args=(t,)) for t in ("free", "platinum")]
        with streaming(real, api_key(real, "standard"), max_tokens=900) as blocker:
            next(e for e in events(blocker) if has_token(e))  # running now
            try:
                for count, thread in enumerate(threads, start=1):
                    thread.start()
                    eventually_waiting(real, count)  # queued in this order
                held = pod_metrics(real)[RUNNING] == 1  # the blocker still ran while both queued
            except AssertionError:
                held = False
        # Hung up: the pod aborts the blocker, and its waiting queue decides who runs next.
        for thread in threads:
            if thread.ident is not None:  # started
                thread.join(120)
        if held:
            break
    assert held, "the blocker never outlasted the queueing of both requests"
    assert first == ["platinum", "free"]


def test_cache_salt_isolates_tenants_and_a_cache_group_shares(real: Stack) -> None:
    keys = add_tenants(
        real, [("salt-a", None), ("salt-b", None), ("group-a", "shared"), ("group-b", "shared")]
    )

    def ask(tenant: str, text: str) -> float:
        """The prefix cache hits of the tenant's request, once the pod has counted it."""
        before = pod_metrics(real)
        with sdk(real, keys[tenant]) as client:
            reply = client.chat.completions.create(
                model=model(real), messages=user(text), max_tokens=1
            )
        assert reply.usage is not None and reply.usage.prompt_tokens > 3 * BLOCK_SIZE
        # Hits and queries are counted together: once the queries show the prompt, so do hits.
        prompt = reply.usage.prompt_tokens
        queried = lambda: pod_metrics(real)[QUERIES] - before[QUERIES] >= prompt  # noqa: E731
        eventually(queried, 30, "the pod never counted the request's prefix cache lookup")
        return pod_metrics(real)[HITS] - before[HITS]

    secret = noise("tenant a's secret", 500)
    assert ask("salt-a", secret) == 0  # a prompt never seen
    assert ask("salt-a", secret) >= 3 * BLOCK_SIZE  # the same tenant's repeat: cached
    assert ask("salt-b", secret) == 0  # another tenant's identical prompt: a miss
    assert ask("salt-b", secret) >= 3 * BLOCK_SIZE  # its own repeat hits its own blocks
    shared = noise("the group's system prompt", 500)
    assert ask("group-a", shared) == 0
    assert ask("group-b", shared) >= 3 * BLOCK_SIZE  # the group shares


def test_an_aborted_stream_stops_the_pod_and_is_charged_what_streamed(real: Stack) -> None:
    max_tokens = 900
    # The premise (the pod still generates when the client hangs up) is the machine's: a busy
    # machine's client can take longer to read 5 events and hang up than the pod takes for all
    # 900 tokens (~4 s). It is read after the hang-up (the pod had not generated them all); where
    # it failed the scenario runs again, at most three times.
    for _ in range(3):
        before = pod_metrics(real)
        with streaming(real, api_key(real, "standard"), max_tokens) as reply:
            request_id = reply.headers["x-request-id"]
            seen = 0
            for event in events(reply):
                seen += has_token(event)
                if seen == 5:
                    break
        # the client has hung up
        at_hangup = pod_metrics(real)
        generating = at_hangup[GENERATED] - before[GENERATED] < max_tokens
        eventually(lambda: pod_metrics(real)[RUNNING] == 0, 60, "the pod still generates")
        if generating:
            break
    else:
        pytest.skip("the pod finished each stream before its client could hang up")
    generated = pod_metrics(real)[GENERATED] - before[GENERATED]
    assert seen <= generated < max_tokens  # stopped before max_tokens
    row = recorded(real, {request_id})[request_id]
    assert row["outcome"] == "aborted"
    # Charged what reached the client, at least; never more than the pod generated.
    assert seen <= row["completion_tokens"] <= generated
    assert pod_metrics(real)[GENERATED] - before[GENERATED] == generated  # nothing since


def router_metrics(stack: Stack) -> str:
    with urllib.request.urlopen(stack.metrics["router"], timeout=10) as reply:
        return str(reply.read().decode())


def fleet_load(stack: Stack) -> FleetLoad | None:
    with stack.redis_client() as client:
        raw = client.get(wire.FLEET_LOAD_KEY)
    return None if raw is None else FleetLoad.model_validate_json(raw)


def test_the_router_reads_the_real_pods_metrics(real: Stack) -> None:
    """The pod is pickable, and what the router publishes is made of the pod's own numbers:
    its load rises while a stream runs (vllm:num_requests_running) and the capacity measured
    from the tokens it served (vllm:prompt_tokens_total, vllm:generation_tokens_total)."""
    pod = f"{real.pods[0].host}:{real.pods[0].port}"
    assert f'llmgw_router_pod_pickable{{pod="{pod}"}} 1.0' in router_metrics(real)
    idle = lambda: (load := fleet_load(real)) is not None and load.load == 0  # noqa: E731
    busy = lambda: (load := fleet_load(real)) is not None and load.load > 0  # noqa: E731
    what = lambda: f"fleet load {fleet_load(real)}, pod {pod_metrics(real)}"  # noqa: E731
    eventually(idle, 30, what)
    with streaming(real, api_key(real, "standard"), max_tokens=900) as blocker:
        next(e for e in events(blocker) if has_token(e))
        # Idle before, and nothing else runs on this module's pod: the load is this stream's.
        # (Not asserted that it still runs: 900 tokens take ~4 s, a busy machine's publish can
        # come after; the fleet load is what the router saw, stale for up to a scrape or two.)
        eventually(busy, 30, what)
    eventually(idle, 30, what)
    load = fleet_load(real)
    assert load is not None and load.capacity_tpm > 0 and load.capacity_rpm > 0


def test_the_responses_api_is_served_counted_and_metered_as_the_pod_counts(real: Stack) -> None:
    """The SDK's `responses.create` through the gateway to a real vLLM pod, whole and streamed:
    extauthz counts the prompt vLLM renders from the instructions and the input items exactly
    (the reservation is that prompt plus the cap the pod got as max_output_tokens), and the
    ledger charges what the pod's own counters show."""
    items: Any = [
        {"role": "user", "content": [{"type": "input_text", "text": noise("responses", 60)}]},
        {"role": "assistant", "content": "Sure."},
        {"role": "user", "content": "Go on."},
    ]
    with sdk(real, api_key(real, "standard")) as client:
        create = client.responses.with_raw_response.create
        before = pod_metrics(real)
        raw = create(
            model=model(real), instructions="Be brief.", input=items, max_output_tokens=8,
            extra_body=NO_EOS,
        )  # fmt: skip
        whole = raw.parse()
        row = settled(real, raw.headers["x-request-id"], before)
        assert whole.usage is not None and whole.usage.output_tokens == 8
        assert whole.status == "incomplete"  # ran to its cap, as vLLM says it
        assert (row["prompt_tokens"], row["completion_tokens"]) == (whole.usage.input_tokens, 8)
        assert row["reserved_tokens"] == whole.usage.input_tokens + 8  # counted exactly
        assert row["endpoint"] == wire.RESPONSES_PATH
        before = pod_metrics(real)
        streamed = create(
            model=model(real), input="Tell me a story.", max_output_tokens=10, extra_body=NO_EOS,
            stream=True,
        )  # fmt: skip
        events = list(streamed.parse())
        row = settled(real, streamed.headers["x-request-id"], before)
    done = events[-1]
    assert done.type == "response.completed" and done.response.usage is not None
    assert (row["prompt_tokens"], row["completion_tokens"]) == (
        done.response.usage.input_tokens,
        10,
    )
    assert row["reserved_tokens"] == done.response.usage.input_tokens + 10


def test_a_stored_response_is_continued_and_read_again_at_the_real_pod(real: Stack) -> None:
    """vLLM names the response after the ID the gateway chose (its pod, its tenant), keeps it,
    puts it before the follow-up that names it (the pod's prompt grows by the conversation, and
    the ledger charges what the pod counted), and gives it back to its tenant only."""
    with sdk(real, api_key(real, "standard")) as client:
        first = client.responses.create(
            model=model(real), input="Hello there.", max_output_tokens=6, extra_body=NO_EOS
        )
        assert first.id.startswith("resp_") and first.usage is not None
        before = pod_metrics(real)
        raw = client.responses.with_raw_response.create(
            model=model(real), input="Go on.", max_output_tokens=6, extra_body=NO_EOS,
            previous_response_id=first.id,
        )  # fmt: skip
        follow = raw.parse()
        row = settled(real, raw.headers["x-request-id"], before)
        assert follow.usage is not None and follow.previous_response_id == first.id
        assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
        assert (row["prompt_tokens"], row["completion_tokens"]) == (follow.usage.input_tokens, 6)
        read = client.responses.retrieve(follow.id)
        assert read.id == follow.id and read.output_text == follow.output_text
        with pytest.raises(openai.BadRequestError):
            client.responses.cancel(follow.id)  # vLLM cancels background responses only
    with sdk(real, api_key(real, "free")) as other, pytest.raises(openai.NotFoundError):
        other.responses.retrieve(follow.id)
