"""End to end through the real Envoy, with the unchanged OpenAI SDK."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from llmgw import wire
from sim.types import DEFAULT_MODEL
from tests.e2e.conftest import PATIENT_SCRAPES, api_key, stack_settings
from tests.e2e.test_auth import access_log
from tests.eventually import eventually
from tests.http import Reply, call
from tools.stack import Stack


@pytest.fixture
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=stack.base_url, api_key=api_key(stack), max_retries=0) as sdk:
        yield sdk


@pytest.fixture
def auth(stack: Stack) -> dict[str, str]:
    return {"authorization": f"Bearer {api_key(stack)}"}


@pytest.fixture
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def assert_openai_error(resp: Reply, status: int, code: str | None) -> dict[str, Any]:
    assert resp.status == status, resp.body
    assert resp.headers["content-type"] == "application/json"
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "code", "param"}
    assert error["message"]
    assert error["code"] == code
    return error


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert models and models[0].object == "model"


def test_chat_completion(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello"}], max_tokens=12
    )
    assert reply.choices[0].message.content
    assert reply.usage is not None and reply.usage.completion_tokens == 12
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 12


def test_completion(client: openai.OpenAI, model: str) -> None:
    reply = client.completions.create(model=model, prompt="Once upon a time", max_tokens=5)
    assert reply.choices[0].text
    assert reply.usage is not None and reply.usage.completion_tokens == 5


def test_stream_arrives_before_generation_ends(client: openai.OpenAI, model: str) -> None:
    start = time.monotonic()
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Tell me a long story"}],
        max_tokens=200,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},  # all 200, not the 'model's' natural length
    )
    arrivals: list[float] = []
    usage = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.monotonic() - start)
        if chunk.usage is not None:
            usage = chunk.usage
    assert len(arrivals) == 200  # one token per chunk, like vLLM
    assert usage is not None and usage.completion_tokens == 200
    # 200 decode steps take a while even on fast pods; the first token must not wait for them.
    assert arrivals[0] < arrivals[-1] / 2


def test_unknown_model_is_vllms_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        )


def test_unknown_path_is_an_openai_404(stack: Stack, auth: dict[str, str]) -> None:
    resp = call("POST", stack.base_url.replace("/v1", "/v2/nothing"), {}, auth)
    error = assert_openai_error(resp, 404, None)
    assert error["type"] == "invalid_request_error"
    assert "/v2/nothing" in str(error["message"])


def test_unknown_path_raises_not_found_in_the_sdk(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.get("/fine_tuning/jobs", cast_to=object)


def test_oversize_body_is_an_openai_413(
    stack: Stack, client: openai.OpenAI, model: str, auth: dict[str, str]
) -> None:
    limit = stack.settings.envoy.max_request_bytes
    huge = "x" * (limit + 1)
    resp = call(
        "POST",
        f"{stack.base_url}/chat/completions",
        {"model": model, "messages": [{"role": "user", "content": huge}]},
        auth,
    )
    error = assert_openai_error(resp, 413, "request_too_large")
    assert error["type"] == "invalid_request_error"
    with pytest.raises(openai.APIStatusError) as raised:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": huge}])
    assert raised.value.status_code == 413


def router_metrics(stack: Stack) -> str:
    with urllib.request.urlopen(stack.metrics["router"], timeout=10) as reply:
        return str(reply.read().decode())


def test_destination_header_from_the_client_is_ignored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client cannot pick the pod by sending the router's own header (the endpoint picker
    protocol's `x-gateway-destination-endpoint`) naming one. The pod it names here is real but
    serves another model, so a request that went there would be that pod's 404; the router's
    pick, the one pod serving the model, serves it. (A made-up address would prove nothing:
    Envoy's override_host falls back to its own choice for a host not in the cluster.)"""
    for name, value in PATIENT_SCRAPES.items():  # the router's pick however busy the machine
        monkeypatch.setenv(name, value)
    settings = stack_settings().model_copy(update={"pod_args": ((), ("--model", "other-model"))})
    with Stack(settings, tmp_path / "stack") as stack:
        serving, named = (f"{pod.host}:{pod.port}" for pod in stack.pods)
        # Until the router knows both pods (else Envoy's fallback picks, by chance either).
        wanted = [f'llmgw_router_pod_pickable{{pod="{pod}"}} 1.0' for pod in (serving, named)]
        known = lambda: all(w in router_metrics(stack) for w in wanted)  # noqa: E731
        eventually(known, 30, lambda: router_metrics(stack))
        resp = call(
            "POST",
            f"{stack.base_url}/chat/completions",
            {
                "model": DEFAULT_MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
            },
            headers={"authorization": f"Bearer {api_key(stack)}", wire.DESTINATION_ENDPOINT: named},
        )
        assert resp.status == 200, resp.body
        assert access_log(stack, resp.headers["x-request-id"])["upstream"] == serving
