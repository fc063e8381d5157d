"""`llmgw up` as a user runs it: ready file, supervision, clean stop, no orphans."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.eventually import eventually
from tests.http import call

READY_TIMEOUT = 90


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is dead, only not yet reaped
        return stat.read().split()[2] != "Z"


@pytest.fixture
def up(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], dict[str, Any], Path]]:
    ready = tmp_path / "ready.json"
    log = tmp_path / "up.log"
    argv = [sys.executable, "-m", "llmgw", "up", "--listen", "127.0.0.1:0", "--pods", "2"]
    argv += ["--ready-file", str(ready), "--state-dir", str(tmp_path / "state")]
    argv += ["--sim-arg", "--time-scale 0.05"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        eventually(
            lambda: ready.exists() or proc.poll() is not None,
            READY_TIMEOUT,
            "ready file",
            every_s=0.1,
        )
        assert proc.poll() is None, log.read_text()
        yield proc, json.loads(ready.read_text()), log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_up_serves_and_stops_cleanly(
    up: tuple[subprocess.Popen[bytes], dict[str, Any], Path],
) -> None:
    proc, info, log = up
    assert set(info) >= {"base_url", "tenants", "pods", "redis_url"}
    key = info["tenants"][0]["api_key"]
    models = call("GET", f"{info['base_url']}/models", headers={"authorization": f"Bearer {key}"})
    assert models.status == 200
    children = list(info["processes"].values())
    names = {"redis", "postgres", "pod-0", "pod-1", "envoy"}
    names |= {"extauthz", "ledger", "admin"}  # the router and the rate limiter: in extauthz
    assert set(info["processes"]) == names
    assert {t["tier"] for t in info["tenants"]} == {"free", "standard", "platinum"}
    assert "base_url" in log.read_text()
    ready = Path(info["logs"]).parent.parent / "ready.json"  # the fixture's --ready-file
    assert ready.stat().st_mode & 0o077 == 0  # it holds API keys and the database password
    # The run directory and everything in it (logs, configs, the tenants file) are owner-only.
    run = Path(info["logs"])
    for path in [run, *run.rglob("*")]:
        assert path.stat().st_mode & 0o077 == 0, (path, oct(path.stat().st_mode))
    assert info["database_url"] not in log.read_text()
    # The run directory has its ready file too, whatever --ready-file named: `llmgw keys` finds
    # there that the admin API owns the tenants, and refuses to edit the file (a link too).
    assert json.loads((run / "ready.json").read_text())["admin_url"] == info["admin_url"]
    link = run.parent / "tenants-link.yaml"
    link.symlink_to(run / "tenants.yaml")
    for tenants in (run / "tenants.yaml", link):
        revoke = [sys.executable, "-m", "llmgw", "keys", "revoke", "key_x"]
        refused = subprocess.run(
            [*revoke, "--tenants-file", str(tenants)], capture_output=True, text=True, timeout=60
        )
        assert refused.returncode == 1 and info["admin_url"] in refused.stderr, refused.stderr
    # Redis's generated password: in the ready file's URL only, not on stdout, in a child's log
    # or in Redis's command line as `ps` shows it (redis-server rewrites its process title).
    password = urlsplit(info["redis_url"]).password
    assert password and len(password) >= 24
    assert password not in log.read_text()
    for child_log in Path(info["logs"]).glob("*.log"):
        assert password not in child_log.read_text(errors="replace"), child_log.name
    cmdline = Path(f"/proc/{info['processes']['redis']}/cmdline").read_bytes()
    assert password.encode() not in cmdline

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert not [pid for pid in children if pid_alive(pid)]
    assert not (run / "ready.json").exists() and not ready.exists()  # no stack runs


def test_a_dead_pod_is_reported_restarted_and_the_stack_stays_up(
    up: tuple[subprocess.Popen[bytes], dict[str, Any], Path],
) -> None:
    proc, info, log = up
    pod_pid = info["pods"][0]["pid"]
    os.kill(pod_pid, signal.SIGKILL)
    eventually(
        lambda: "child exited" in log.read_text(), 10, "the launcher to report the pod", every_s=0.1
    )
    assert "pod-0" in log.read_text()
    assert proc.poll() is None

    def restarted() -> bool:  # the ready file names the new pid
        return json.loads(ready.read_text())["pods"][0]["pid"] not in (None, pod_pid)

    ready = Path(info["logs"]).parent.parent / "ready.json"  # the fixture's --ready-file
    eventually(restarted, 60, "the launcher to restart the pod", every_s=0.1)
    assert "child restarted" in log.read_text()
    auth = {"authorization": f"Bearer {info['tenants'][0]['api_key']}"}
    model = call("GET", f"{info['base_url']}/models", headers=auth).json()["data"][0]["id"]
    body = {"model": model, "prompt": "hi", "max_tokens": 2}
    assert call("POST", f"{info['base_url']}/completions", body, auth).status == 200


def test_killed_launcher_leaves_no_orphans(
    up: tuple[subprocess.Popen[bytes], dict[str, Any], Path],
) -> None:
    proc, info, _ = up
    children = list(info["processes"].values())
    proc.kill()
    proc.wait()
    eventually(
        lambda: not [p for p in children if pid_alive(p)], 10, "children to exit", every_s=0.1
    )
