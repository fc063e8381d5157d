"""extauthz through the real Envoy: keys, trusted context, sessions, hot reload, fail closed."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path

import openai
import pytest

from extauthz import tenants
from tests.e2e.conftest import api_key, stack_settings
from tests.eventually import eventually
from tests.http import Reply, call
from tests.recording_pod import MODEL, STREAM_TAIL, recording_pod
from tools import cli
from tools.stack import Stack

RELOAD_SECONDS = 2.0  # a key change must apply within this


def chat(stack: Stack, headers: dict[str, str], body: dict[str, object] | None = None) -> Reply:
    body = body or {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    model = body.get("model") or served_model(stack)
    return call("POST", f"{stack.base_url}/chat/completions", {"model": model, **body}, headers)


def served_model(stack: Stack) -> str:
    auth = {"authorization": f"Bearer {api_key(stack)}"}
    return str(call("GET", f"{stack.base_url}/models", headers=auth).json()["data"][0]["id"])


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def assert_error(reply: Reply, status: int, code: str) -> None:
    assert reply.status == status, reply.body
    assert reply.headers["content-type"] == "application/json"
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "code", "param"}
    assert error["code"] == code


def create_key(stack: Stack, tenant: str, capsys: pytest.CaptureFixture[str], *extra: str) -> str:
    argv = ["keys", "create", "--tenant", tenant, "--tenants-file", str(stack.tenants_file)]
    assert cli.main([*argv, *extra]) == 0
    return capsys.readouterr().out.strip()


def key_id(path: Path, key: str) -> str:
    digest = tenants.digest(key).hex()
    return next(k.id for t in tenants.read(path).tenants for k in t.keys if k.sha256 == digest)


def access_log(stack: Stack, request_id: str) -> dict[str, str]:
    """The access-log entry of one request (the log is flushed every 200 ms)."""
    found: dict[str, str] = {}

    def logged() -> bool:
        for line in stack.access_log.read_text().splitlines():
            entry = json.loads(line)
            if entry["request_id"] == request_id:
                found.update(entry)
                return True
        return False

    eventually(logged, 5, f"access log entry {request_id}")
    return found


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"authorization": "Bearer"},
        {"authorization": "Basic dXNlcjpwYXNz"},
        {"authorization": "Bearer sk-llmgw-" + "A" * 43},
        {"api-key": "not-a-key"},
    ],
    ids=["missing", "empty", "basic", "unknown", "api-key-unknown"],
)
def test_bad_keys_are_401(stack: Stack, headers: dict[str, str]) -> None:
    assert_error(chat(stack, headers), 401, "invalid_api_key")


def test_sdk_raises_authentication_error(stack: Stack) -> None:
    with (
        openai.OpenAI(base_url=stack.base_url, api_key="sk-llmgw-nope", max_retries=0) as client,
        pytest.raises(openai.AuthenticationError),
    ):
        client.models.list()


def test_api_key_header_is_accepted(stack: Stack) -> None:
    assert chat(stack, {"api-key": api_key(stack)}).status == 200


def test_expired_and_revoked_keys_stop_working(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    expiring = create_key(stack, "demo-standard", capsys, "--expires", "2s")
    revoked = create_key(stack, "demo-standard", capsys)
    eventually(lambda: chat(stack, bearer(expiring)).status == 200, RELOAD_SECONDS, "new key")
    eventually(lambda: chat(stack, bearer(revoked)).status == 200, RELOAD_SECONDS, "new key")

    revoke = ["keys", "revoke", key_id(stack.tenants_file, revoked)]
    assert cli.main([*revoke, "--tenants-file", str(stack.tenants_file)]) == 0
    eventually(lambda: chat(stack, bearer(revoked)).status == 401, RELOAD_SECONDS, "revocation")
    assert_error(chat(stack, bearer(revoked)), 401, "invalid_api_key")
    eventually(lambda: chat(stack, bearer(expiring)).status == 401, 5, "expiry")
    assert_error(chat(stack, bearer(expiring)), 401, "invalid_api_key")


def test_forged_context_headers_never_reach_the_pod(tmp_path: Path) -> None:
    forged = {
        "x-llmgw-tenant": "demo-platinum",
        "x-llmgw-tier": "platinum",
        "x-llmgw-priority": "10",
        "x-llmgw-model": "other",
        "x-llmgw-made-up": "1",
        "x-gateway-destination-endpoint": "127.0.0.1:1",
        "x-gateway-destination-endpoint-served": "127.0.0.1:1",
        "x-data-parallel-rank": "3",  # vLLM's pick of a data-parallel engine
    }
    with recording_pod() as pod:
        settings = stack_settings().model_copy(update={"upstreams": (pod.address,), "pods": 0})
        with Stack(settings, tmp_path / "stack") as stack:
            key = api_key(stack, "free")
            # vLLM's engine request id, when no X-Request-Id names it.
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "request_id": "forged",
            }
            reply = call(
                "POST", f"{stack.base_url}/chat/completions", body, {**bearer(key), **forged}
            )
            assert reply.status == 200, reply.body
            entry = access_log(stack, reply.headers["x-request-id"])
    (received,) = pod.requests
    assert entry["tenant"] == "demo-free"
    assert received.headers["x-llmgw-tenant"] == "demo-free"
    assert received.headers["x-llmgw-tier"] == "free"
    assert received.headers["x-llmgw-model"] == MODEL
    assert received.headers["x-llmgw-priority"] != "10"
    assert "x-llmgw-made-up" not in received.headers
    for name in ("x-gateway-destination-endpoint", "x-gateway-destination-endpoint-served"):
        assert name not in received.headers
    assert "x-data-parallel-rank" not in received.headers
    # The gateway's request id, in the header and the body alike.
    assert received.headers["x-request-id"] == reply.headers["x-request-id"]
    assert received.body["request_id"] == reply.headers["x-request-id"]
    # The pod never sees the client's key.
    assert "authorization" not in received.headers
    assert all(key not in value for value in received.headers.values())


def test_the_pods_serve_v1_only_to_the_gateway(stack: Stack) -> None:
    """The pods ask for their API key (vLLM's --api-key): /v1 straight to a pod is vLLM's 401,
    with no key or a tenant's; /health and /metrics stay open. Through Envoy, which sends the
    key, the request is served, and nothing of the key comes back to the client."""
    assert stack.pod_api_key
    pod = stack.pod_url(0)
    body = {"model": served_model(stack), "prompt": "hi", "max_tokens": 2}
    for headers in ({}, bearer(api_key(stack)), bearer(stack.pod_api_key[:-1])):
        for method, path, sent in [("POST", "/v1/completions", body), ("GET", "/v1/models", None)]:
            refused = call(method, f"{pod}{path}", sent, headers)
            assert (refused.status, refused.json()) == (401, {"error": "Unauthorized"}), path
    assert call("GET", f"{pod}/health").status == 200
    assert call("GET", f"{pod}/metrics").status == 200
    served = call("GET", f"{pod}/v1/models", headers=bearer(stack.pod_api_key))
    assert served.status == 200
    reply = call("POST", f"{stack.base_url}/completions", body, bearer(api_key(stack)))
    assert reply.status == 200, reply.body
    assert stack.pod_api_key not in f"{reply.headers}{reply.body!r}"


def test_the_pods_own_session_and_rate_headers_never_reach_the_client(tmp_path: Path) -> None:
    """The gateway's x-session-id and x-ratelimit-* are the only ones the client gets: over HTTP
    Envoy appends the check's headers to the pod's response, so a pod (or a proxy in front of a
    hosted API) sending its own would give the client two, which an SDK joins into one value
    that is no session."""
    with recording_pod() as pod:
        pod.response_headers = {"x-session-id": "pod-session", "x-ratelimit-limit-requests": "7"}
        settings = stack_settings().model_copy(update={"upstreams": (pod.address,), "pods": 0})
        with Stack(settings, tmp_path / "stack") as stack:
            assert stack.services.check_over_http
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
            request = urllib.request.Request(
                f"{stack.base_url}/chat/completions",
                data=json.dumps(body).encode(),
                headers={**bearer(api_key(stack, "free")), "content-type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=30) as reply:
                sessions = reply.headers.get_all("x-session-id")
                limits = reply.headers.get_all("x-ratelimit-limit-requests")
    assert len(sessions) == 1 and sessions[0].startswith("sess_"), sessions
    assert len(limits) == 1 and limits[0] != "7", limits


def test_a_rewritten_stream_delivers_its_held_tail(tmp_path: Path) -> None:
    """usage.lua holds a partial event while it strips usage the client did not ask for; at the
    end of the stream what it holds goes out too (the pod's bytes, minus the usage event)."""
    with recording_pod() as pod:
        settings = stack_settings().model_copy(update={"upstreams": (pod.address,), "pods": 0})
        with Stack(settings, tmp_path / "stack") as stack:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
            reply = call("POST", f"{stack.base_url}/chat/completions", body, bearer(api_key(stack)))
    assert reply.status == 200, reply.body
    assert b'"usage"' not in reply.body  # stripped: the client did not ask for it
    assert b'"content": "ok"' in reply.body
    assert reply.body.endswith(b"\n\n" + STREAM_TAIL)


def test_sessions_are_minted_continued_and_bound_to_the_tenant(stack: Stack) -> None:
    platinum, free = bearer(api_key(stack, "platinum")), bearer(api_key(stack, "free"))
    first = chat(stack, platinum)
    session = first.headers["x-session-id"]
    assert session.startswith("sess_")
    again = chat(stack, {**platinum, "x-session-id": session})
    assert again.status == 200 and again.headers["x-session-id"] == session

    assert_error(chat(stack, {**free, "x-session-id": session}), 400, "invalid_session_id")
    mutated = session[:-1] + ("A" if session[-1] != "A" else "B")
    assert_error(chat(stack, {**platinum, "x-session-id": mutated}), 400, "invalid_session_id")


def test_sdk_continues_a_session_with_default_headers(stack: Stack) -> None:
    with openai.OpenAI(base_url=stack.base_url, api_key=api_key(stack), max_retries=0) as client:
        raw = client.chat.completions.with_raw_response.create(
            model=served_model(stack), messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        session = raw.headers["x-session-id"]
        continued = client.with_options(default_headers={"X-Session-ID": session})
        raw = continued.chat.completions.with_raw_response.create(
            model=served_model(stack), messages=[{"role": "user", "content": "more"}], max_tokens=2
        )
    assert raw.headers["x-session-id"] == session


def test_model_not_allowed_is_403(stack: Stack, capsys: pytest.CaptureFixture[str]) -> None:
    with tenants.editing(stack.tenants_file):
        data = tenants.read(stack.tenants_file)
        restricted = [
            t.model_copy(update={"models": ("some-other-model",)}) if t.id == "demo-free" else t
            for t in data.tenants
        ]
        tenants.write(stack.tenants_file, data.model_copy(update={"tenants": tuple(restricted)}))
    key = bearer(api_key(stack, "free"))
    eventually(lambda: chat(stack, key).status == 403, RELOAD_SECONDS, "model restriction")
    assert_error(chat(stack, key), 403, "model_not_allowed")
    free = openai.OpenAI(base_url=stack.base_url, api_key=api_key(stack, "free"), max_retries=0)
    with free as client, pytest.raises(openai.PermissionDeniedError):
        client.chat.completions.create(
            model=served_model(stack), messages=[{"role": "user", "content": "hi"}]
        )
    with tenants.editing(stack.tenants_file):
        tenants.write(stack.tenants_file, data)
    eventually(lambda: chat(stack, key).status == 200, RELOAD_SECONDS, "restriction lifted")


async def test_reload_and_revocation_under_load_fail_no_other_tenant(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    client = openai.AsyncOpenAI(base_url=stack.base_url, api_key=api_key(stack), max_retries=0)
    model = served_model(stack)
    stop = asyncio.Event()
    outcomes: list[BaseException | None] = []

    async def steady() -> None:
        for i in range(2000):  # bounded; stops as soon as the key changes are done
            if stop.is_set():
                return
            try:
                await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": f"{i}"}], max_tokens=2
                )
                outcomes.append(None)
            except openai.APIError as exc:
                outcomes.append(exc)

    def churn_keys() -> None:
        for _ in range(3):
            key = create_key(stack, "demo-standard", capsys)
            works = lambda k=key: chat(stack, bearer(k)).status == 200  # noqa: E731
            eventually(works, RELOAD_SECONDS, "new key")
            argv = ["keys", "revoke", key_id(stack.tenants_file, key)]
            assert cli.main([*argv, "--tenants-file", str(stack.tenants_file)]) == 0
            refused = lambda k=key: chat(stack, bearer(k)).status == 401  # noqa: E731
            eventually(refused, RELOAD_SECONDS, "revocation")

    async def churn() -> None:
        try:
            await asyncio.to_thread(churn_keys)
        finally:
            stop.set()

    async with client:
        await asyncio.gather(churn(), *(steady() for _ in range(4)))
    assert len(outcomes) > 20
    assert [o for o in outcomes if o is not None] == []


def test_auth_service_down_is_an_openai_503(own_stack: Stack) -> None:
    next(p for p in own_stack.processes if p.name == "extauthz").kill()
    reply = chat(own_stack, bearer(api_key(own_stack)), {"model": "any", "messages": []})
    assert reply.status == 503, reply.body
    error = reply.json()["error"]
    assert error["type"] == "server_error" and "authorization" in error["message"]
    assert error["code"] == "authorization_unavailable"
    assert reply.headers["retry-after"] == "1"  # the SDK waits, then retries


def test_bodies_up_to_envoys_limit_are_authorized_not_refused_as_unavailable(stack: Stack) -> None:
    """gRPC's default 4 MiB message limit once turned 4-8 MiB bodies into 503s (retried by SDKs)."""
    text = "ab " * (9 * 512 * 1024 // 3)  # 4.5 MiB, above gRPC's default limit
    reply = chat(stack, bearer(api_key(stack)), {"messages": [{"role": "user", "content": text}]})
    assert reply.status != 503, reply.body  # extauthz decided; what the pod says is the pod's
    too_big = chat(
        stack, bearer(api_key(stack)), {"messages": [{"role": "user", "content": text * 2}]}
    )
    assert_error(too_big, 413, "request_too_large")


def test_json_nested_too_deep_is_a_400_not_an_outage(stack: Stack) -> None:
    body = (
        b'{"messages": [{"role": "user", "content": "hi"}], "x": '
        + b"[" * 100_000
        + b"]" * 100_000
        + b"}"
    )
    reply = call("POST", f"{stack.base_url}/chat/completions", body, bearer(api_key(stack)))
    assert_error(reply, 400, "invalid_json")
