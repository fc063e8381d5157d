"""The ready file's pods (tools/stack.py ready_info, tools/serving.py): each names the model it
serves and its context, whatever the engine, read from where that engine takes them."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from sim.types import DEFAULT_MODEL
from tools.engine import VllmSettings
from tools.procs import free_port
from tools.serving import Serving
from tools.stack import Stack, StackSettings

KEY = "pods-key"
CARD = {"id": "acme/llama-8b", "object": "model", "owned_by": "vllm", "max_model_len": 8192}


class Models(BaseHTTPRequestHandler):
    """/v1/models as vLLM answers it, to a caller with the pods' key only."""

    def do_GET(self) -> None:
        ok = self.path == "/v1/models" and self.headers["authorization"] == f"Bearer {KEY}"
        body = json.dumps({"object": "list", "data": [CARD]} if ok else {"error": "no"}).encode()
        self.send_response(200 if ok else 401)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def upstream() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Models)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def pods(settings: StackSettings, tmp_path: Path) -> list[dict[str, Any]]:
    stack = Stack(settings, tmp_path / "stack")
    try:
        stack._start_pods()
        return list(stack.ready_info()["pods"])
    finally:
        stack.stop()


def test_a_simulated_pod_as_its_own_flags_configure_it(tmp_path: Path) -> None:
    flags = ("--model", "acme/sim", "--max-model-len", "4096", "--time-scale", "0.05")
    [pod] = pods(StackSettings(pods=1, sim_args=flags), tmp_path)
    assert (pod["engine"], pod["simulated"]) == ("sim", True)
    assert (pod["model"], pod["max_model_len"]) == ("acme/sim", 4096)


def test_a_simulated_pod_with_the_simulators_defaults() -> None:
    assert Serving.simulated([]) == Serving(DEFAULT_MODEL, 131072)


def test_a_real_vllm_pod_as_its_settings_start_it() -> None:
    settings = VllmSettings(served_model_name="acme/tiny", max_model_len=512)
    assert Serving.vllm(settings) == Serving("acme/tiny", 512)


def test_an_upstream_as_its_models_document_says(upstream: str, tmp_path: Path) -> None:
    settings = StackSettings(upstreams=(upstream,), pod_api_key=KEY)
    [pod] = pods(settings, tmp_path)
    assert (pod["engine"], pod["simulated"]) == ("external", False)
    assert (pod["model"], pod["max_model_len"]) == ("acme/llama-8b", 8192)


def test_an_upstream_that_does_not_answer_is_unknown(upstream: str, tmp_path: Path) -> None:
    gone = f"127.0.0.1:{free_port()}"
    refused = StackSettings(upstreams=(upstream, gone), pod_api_key="another key")
    assert [(p["model"], p["max_model_len"]) for p in pods(refused, tmp_path)] == [(None, None)] * 2
