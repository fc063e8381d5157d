"""`python -m sim` as the launcher runs it: flags, clean SIGTERM, the `die` fault."""

from __future__ import annotations

import json
import socket
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from sim.__main__ import settings_from
from tools.procs import Process, free_port, http_ok

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pod_process(tmp_path: Path) -> Iterator[tuple[Process, str]]:
    port = free_port()
    argv = [sys.executable, "-m", "sim", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--model", "tiny", "--time-scale", "0.05", "--seed", "3", "--max-num-seqs", "8"]
    url = f"http://127.0.0.1:{port}"
    proc = Process("pod", argv, http_ok(url + "/health"), tmp_path / "pod.log")
    proc.start(timeout=30)
    yield proc, url
    proc.kill()


def request(url: str, method: str = "GET", body: object = None) -> object:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.loads(resp.read())


def test_flags_reach_the_pod_and_sigterm_exits_0(pod_process: tuple[Process, str]) -> None:
    proc, url = pod_process
    models = request(url + "/v1/models")
    assert isinstance(models, dict) and models["data"][0]["id"] == "tiny"
    # An open stream does not hold up the shutdown.
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as conn:
        body = json.dumps({"prompt": "x", "max_tokens": 500, "stream": True}).encode()
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        head += f"Content-Length: {len(body)}\r\n\r\n"
        conn.sendall(head.encode() + body)
        assert conn.recv(100).startswith(b"HTTP/1.1 200")
        assert proc.stop(timeout=10) == 0


def test_die_exits_at_once_with_code_1(pod_process: tuple[Process, str]) -> None:
    proc, url = pod_process
    assert request(url + "/admin/faults", "PUT", {"die": True}) is not None
    assert proc.popen is not None and proc.popen.wait(timeout=10) == 1


def test_flags_override_the_config_file(tmp_path: Path) -> None:
    config = tmp_path / "sim.yaml"
    config.write_text("model: from-file\nseed: 4\nmax_num_seqs: 3\n")
    settings = settings_from(["--config", str(config), "--seed", "5", "--speed-factor", "2"])
    assert (settings.model, settings.seed, settings.max_num_seqs) == ("from-file", 5, 3)
    assert settings.speed_factor == 2 and not settings.force_include_usage
    assert settings_from(["--force-include-usage"]).force_include_usage
    assert settings.usage_mode == "per-chunk" and settings.scheduling_policy == "fcfs"
    assert settings.max_num_batched_tokens is None  # the profile's
    flags = ["--usage-mode", "final", "--scheduling-policy", "priority"]
    flags += ["--max-num-batched-tokens", "512"]
    chosen = settings_from(flags)
    assert (chosen.usage_mode, chosen.scheduling_policy) == ("final", "priority")
    assert chosen.max_num_batched_tokens == 512
