"""`python -m ledger` as a process: Envoy's access-log stream in, metrics out, clean SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from tests.eventually import eventually
from tests.ledger.test_entry import USED, entry
from tools import procs


def metrics(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as reply:
        return str(reply.read().decode())


def test_python_m_ledger_takes_access_logs_and_stops_on_sigterm(tmp_path: Path) -> None:
    port, metrics_port = procs.free_port(), procs.free_port()
    env = {
        **os.environ,
        "LLMGW_LEDGER__SERVE__PORT": str(port),
        "LLMGW_LEDGER__SERVE__METRICS_PORT": str(metrics_port),
        "LLMGW_LEDGER__REDIS__PORT": str(procs.free_port()),  # nobody there: outcomes wait
        "LLMGW_LEDGER__DRAIN_S": "0.5",
    }
    proc = procs.Process(
        "ledger",
        [sys.executable, "-m", "ledger"],
        procs.grpc_serving(f"127.0.0.1:{port}", "ledger"),
        tmp_path / "ledger.log",
        env=env,
    ).start()
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    try:
        message = als_pb2.StreamAccessLogsMessage()
        message.http_logs.log_entry.extend(
            [entry(200, usage=USED, request_id=f"r{i}") for i in range(3)]
        )

        def once() -> Iterator[als_pb2.StreamAccessLogsMessage]:
            yield message

        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            als_pb2_grpc.AccessLogServiceStub(channel).StreamAccessLogs(once(), timeout=5)
        eventually(lambda: "llmgw_ledger_unsettled 3.0" in metrics(url), 10, lambda: metrics(url))
        assert "llmgw_ledger_log_entries_total 3.0" in metrics(url)
        assert proc.popen is not None
        proc.popen.send_signal(signal.SIGTERM)
        assert proc.popen.wait(15) == 0, proc.log_tail()
    finally:
        proc.stop()


def test_check_config(tmp_path: Path) -> None:
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text("settle: {batch_max: 100}\n")
    bad.write_text("settle: {batch_max: 0}\n")
    run = [sys.executable, "-m", "ledger", "--check-config"]
    assert subprocess.run([*run, str(good)], capture_output=True, check=False).returncode == 0
    refused = subprocess.run([*run, str(bad)], capture_output=True, text=True, check=False)
    assert refused.returncode == 1 and "settle.batch_max" in refused.stderr
