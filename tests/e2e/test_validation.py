"""Every request is validated before a pod sees it, through real Envoy and extauthz, with a pod
that records what it receives (tests/recording_pod.py). Refused requests are never charged."""

from __future__ import annotations

import contextlib
import gzip
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import api_key, stack_settings
from tests.http import Reply, call
from tests.recording_pod import MODEL, RecordingPod, recording_pod
from tools.stack import Stack


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, RecordingPod]]:
    with recording_pod() as pod:
        settings = stack_settings().model_copy(update={"upstreams": (pod.address,), "pods": 0})
        with Stack(settings, tmp_path_factory.mktemp("validation") / "stack") as stack:
            yield stack, pod


def post(stack: Stack, body: bytes, **headers: str) -> Reply:
    auth = {"authorization": f"Bearer {api_key(stack)}", "content-type": "application/json"}
    return call("POST", f"{stack.base_url}/chat/completions", body, {**auth, **headers})


def refused(reply: Reply, status: int, code: str, param: str | None = None) -> None:
    assert reply.status == status, reply.body
    assert reply.headers["content-type"] == "application/json"
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "code", "param"}
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", code, param)


def test_bad_bodies_are_refused_at_the_gateway(recorded: tuple[Stack, RecordingPod]) -> None:
    stack, pod = recorded
    before = len(pod.requests)
    refused(post(stack, b"{not json"), 400, "invalid_json")
    refused(post(stack, b'["a", "list"]'), 400, "invalid_json")
    refused(post(stack, b""), 400, "invalid_json")
    # No model: the pod would serve its default one, whatever the tenant may use.
    no_model = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    refused(post(stack, no_model), 400, "missing_model", "model")
    refused(
        post(stack, json.dumps({"model": 7, "messages": []}).encode()),
        400,
        "missing_model",
        "model",
    )
    # A compressed body: the gateway could not read what the pod would decode.
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
    gz = post(stack, gzip.compress(body), **{"content-encoding": "gzip"})
    refused(gz, 415, "unsupported_content_encoding", "content-encoding")
    assert len(pod.requests) == before  # none of them reached the pod
    assert post(stack, body).status == 200 and len(pod.requests) == before + 1


def test_only_the_api_paths_and_methods_reach_the_pod(recorded: tuple[Stack, RecordingPod]) -> None:
    stack, pod = recorded
    auth = {"authorization": f"Bearer {api_key(stack)}"}
    base = stack.base_url.removesuffix("/v1")
    before = len(pod.requests)
    for method, path in [
        ("PUT", "/v1/models/../../admin/faults"),
        ("GET", "/v1/models/../../admin/faults"),
        ("GET", "/v1//models/..%2F..%2Fadmin"),
        ("GET", "/v1/chat/completions"),
        ("DELETE", "/v1/models"),
        ("POST", "/v1/models"),
    ]:
        reply = call(method, f"{base}{path}", None, auth)
        assert reply.status in (400, 404), (method, path, reply.status)
        assert "error" in reply.json(), (method, path)
    assert len(pod.requests) == before
    assert call("GET", f"{stack.base_url}/models", None, auth).status == 200


def test_no_key_is_refused_before_the_body_is_buffered(
    recorded: tuple[Stack, RecordingPod],
) -> None:
    """A declared 8 MB body, 1 kB sent, no key: answered at once, not after a timeout."""
    stack, _ = recorded
    host, port = stack.listen.host, stack.listen.port
    with socket.create_connection((host, port), timeout=5) as sock:
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            "content-length: 8000000\r\n\r\n"
        )
        sock.sendall(head.encode() + b"{" + b" " * 1024)
        started = time.monotonic()
        reply = sock.recv(65536)
        waited = time.monotonic() - started
    assert reply.startswith(b"HTTP/1.1 401"), reply[:80]
    assert b'"invalid_api_key"' in reply
    assert waited < 2.0  # not the idle or request timeout (10 s, 30 s)


def test_a_strangers_large_body_is_refused_by_extauthz_at_its_head(
    recorded: tuple[Stack, RecordingPod],
) -> None:
    """A key of our shape but nobody's, with 4 MB: extauthz answers at the check's head and
    drops the body Envoy sends after it; Envoy passes the 401 on, and checks go on."""
    stack, _ = recorded
    body = json.dumps({"model": MODEL, "messages": [], "x": "a" * (4 << 20)}).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"authorization: Bearer sk-llmgw-{'y' * 43}\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    for _ in range(2):
        # Read while sending, as curl does: Envoy answers at the head and closes without
        # reading the rest, so a client that sends all 4 MB first may see only the reset.
        with socket.create_connection((stack.listen.host, stack.listen.port), timeout=30) as sock:
            sock.sendall(head.encode())
            sender = threading.Thread(target=send_ignoring_reset, args=(sock, body))
            sender.start()
            reply = b""
            while b"invalid_api_key" not in reply and (chunk := sock.recv(65536)):
                reply += chunk
            sender.join()
        assert reply.startswith(b"HTTP/1.1 401"), reply[:80]
        assert b'"invalid_api_key"' in reply
    assert post(stack, json.dumps({"model": MODEL, "messages": []}).encode()).status == 200


def send_ignoring_reset(sock: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):  # the peer closed: it answered already
        sock.sendall(data)


@pytest.mark.parametrize(
    "auth",
    [
        "",
        "authorization: Bearer not-our-key\r\n",
        f"authorization: Bearer sk-llmgw-{'n' * 43}\r\n",  # our shape, nobody's key
    ],
)
def test_expect_100_continue_without_a_key_gets_the_401_and_sends_no_body(
    recorded: tuple[Stack, RecordingPod], auth: str
) -> None:
    """`Expect: 100-continue` is answered by Envoy itself (proxy_100_continue unset), before any
    filter: the stranger's 401 follows at once, from its headers, and Envoy closes the
    connection. Not one byte of the declared body is sent here, and nothing waits for it."""
    stack, _ = recorded
    with socket.create_connection((stack.listen.host, stack.listen.port), timeout=5) as sock:
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: 8000000\r\nexpect: 100-continue\r\n{auth}\r\n"
        )
        sock.sendall(head.encode())
        reply = b""
        while chunk := sock.recv(65536):  # until Envoy closes (a timeout fails the test)
            reply += chunk
    statuses = [line for line in reply.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")]
    assert statuses[-1].startswith(b"HTTP/1.1 401"), reply[:200]
    assert b"connection: close" in reply.lower()
    assert b'"invalid_api_key"' in reply


def test_no_log_holds_a_key(recorded: tuple[Stack, RecordingPod]) -> None:
    """A run full of denied requests: no log file of any process holds the keys it used."""
    stack, _ = recorded
    key = api_key(stack)
    revoked_looking = "sk-llmgw-" + "x" * 43
    bodies = [b"{not json", json.dumps({"model": "m", "messages": []}).encode()]
    for body in bodies:
        post(stack, body)
        post(stack, body, authorization=f"Bearer {revoked_looking}")
        post(stack, body, **{"x-session-id": "sess_forged"})
    call("POST", f"{stack.base_url}/chat/completions?api_key={key}", b"{}", {"api-key": key})
    call(
        "GET", f"{stack.base_url}/models?key={revoked_looking}", None, {"api-key": revoked_looking}
    )
    post(stack, b"x" * (9 * 1024 * 1024))  # 413
    time.sleep(0.5)  # the file access log flushes every 200 ms
    logs = [p for p in Path(stack.state_dir).rglob("*") if p.is_file() and p.suffix in (".log", "")]
    assert any(p.name == "access.log" for p in logs)
    for path in logs:
        text = path.read_bytes()
        assert key.encode() not in text, path
        assert revoked_looking.encode() not in text, path


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"GET /v1/models HTTP/1.0\r\n\r\n", 426),
        (b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx_under: 1\r\n\r\n", 400),
        (b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 70_000 + b"\r\n\r\n", 431),
        (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n"
         b"content-length: 3\r\n\r\n{}", 400),
        (b"\x16\x03\x01 not http\r\n\r\n", 400),
    ],
)  # fmt: skip
def test_envoys_own_refusals_are_openai_errors(
    recorded: tuple[Stack, RecordingPod], raw: bytes, status: int
) -> None:
    stack, _ = recorded
    with socket.create_connection((stack.listen.host, stack.listen.port), timeout=5) as sock:
        sock.sendall(raw)
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status}".encode()), head[:60]
    assert b"content-type: application/json" in head.lower()
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "code", "param"}
