"""`llmgw up`: bring the local stack up, report it, supervise it, stop it cleanly."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from prometheus_client import start_http_server

from llmgw import wire
from tools.procs import Process
from tools.stack import Stack
from tools.supervisor import Backoff, Supervisor, SupervisorMetrics

log = logging.getLogger("llmgw.up")

POLL_SECONDS = 0.1  # how soon a dead child is noticed


def redacted(url: str) -> str:
    """A URL without its credentials (`redis://:PASSWORD@host` → `redis://host`)."""
    scheme, sep, rest = url.partition("://")
    return scheme + sep + rest.rpartition("@")[2] if sep else url


def banner(info: dict[str, Any]) -> str:
    lines = [
        "llmgw is up.",
        f"  base_url:  {info['base_url']}",
        f"  pods:      {', '.join(str(p['url']) for p in info['pods'])}",
        f"  redis:     {redacted(info['redis_url'])} (password: see the ready file)",
        f"  envoy:     {info['envoy_admin_url']} (its admin; localhost only)",
        f"  logs:      {info['logs']}",
    ]
    if info.get("admin_url"):
        lines += [
            f"  admin API: {info['admin_url']}/admin/v1/ (localhost only; its OpenAPI document:"
            f" {info['admin_url']}/openapi.json)",
            f"  admin token: {info['admin_token']}   (Authorization: Bearer <admin token>)",
            f"  console:   {info['console_url']} (log in with the admin token)",
        ]
    if info.get("database_url"):  # never the URL itself: it carries the password
        lines.append(
            "  ledger:    .venv/bin/llmgw usage --by tenant   (PostgreSQL, see the ready file)"
        )
    for tenant in info["tenants"]:
        lines.append(f"  tenant {tenant['id']} ({tenant['tier']}): api_key={tenant['api_key']}")
    lines += [
        "",
        "  from openai import OpenAI",
        f'  client = OpenAI(base_url="{info["base_url"]}", api_key="...")',
        "",
        "A child that dies is restarted; Ctrl-C stops everything.",
    ]
    return "\n".join(lines)


def write_ready(ready_file: Path, info: dict[str, Any]) -> None:
    """Replace the ready file atomically: readers never see half of it. Owner-only (0600): it
    holds the demo tenants' API keys, the admin token and the Redis and database passwords."""
    tmp = ready_file.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(json.dumps(info, indent=2))
    tmp.chmod(0o600)  # an older tmp file may have had wider bits
    tmp.replace(ready_file)


def supervise(stack: Stack, ready_file: Path | None, backoff: Backoff | None = None) -> int:
    """Run until SIGINT/SIGTERM (exit 0), restarting any child that dies (tools.supervisor).

    The ready file is written in the run directory, and to `ready_file` too when given: `llmgw
    usage`, `spend` and `keys` find the running stack in its run directory whatever the operator
    named. It is rewritten after each restart (new pid, restart counts) and removed at the end;
    the supervisor's metrics (`llmgw_child_restarts_total` ...) are served at
    `metrics.launcher` in it.
    """
    ready_files = {stack.state_dir / wire.READY_FILE} | ({ready_file} if ready_file else set())
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("stopping", extra={"signal": signal.Signals(signum).name})
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)

    metrics = SupervisorMetrics()
    server, _ = start_http_server(0, "127.0.0.1", registry=metrics.registry)
    metrics_url = f"http://127.0.0.1:{server.server_port}/metrics"
    supervisor: Supervisor | None = None

    def report(_restarted: Process | None = None) -> None:
        info = stack.ready_info()
        info["metrics"] = {**info["metrics"], "launcher": metrics_url}
        info["restarts"] = supervisor.restarts() if supervisor else {}
        for path in ready_files:
            write_ready(path, info)

    try:
        stack.start()
        supervisor = Supervisor(stack, backoff or Backoff(), report, metrics=metrics)
        supervisor.step()  # every child known before the first report
        print(banner(stack.ready_info()), flush=True)
        report()
        while not stop.wait(POLL_SECONDS):
            supervisor.step()
    finally:
        stack.stop()
        server.shutdown()
        for path in ready_files:
            path.unlink(missing_ok=True)
    return 0
