"""`llmgw up`: bring the local stack up, report it, supervise it, stop it cleanly."""

from __future__ import annotations

import json
import logging
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from llmgw.stack import Stack

log = logging.getLogger("llmgw.up")

POLL_SECONDS = 0.5


def banner(info: dict[str, Any]) -> str:
    lines = [
        "llmgw is up.",
        f"  base_url:  {info['base_url']}",
        f"  pods:      {', '.join(str(p['url']) for p in info['pods'])}",
        f"  redis:     {info['redis_url']}",
        f"  admin:     {info['envoy_admin_url']} (localhost only)",
        f"  logs:      {info['logs']}",
    ]
    for tenant in info["tenants"]:
        lines.append(f"  tenant {tenant['id']} ({tenant['tier']}): api_key={tenant['api_key']}")
    lines += [
        "",
        "  from openai import OpenAI",
        f'  client = OpenAI(base_url="{info["base_url"]}", api_key="...")',
        "",
        "Ctrl-C stops everything.",
    ]
    return "\n".join(lines)


def supervise(stack: Stack, ready_file: Path | None) -> int:
    """Run until SIGINT/SIGTERM (exit 0) or until a core process dies (exit 1).

    A pod that dies is reported and the stack stays up: Envoy's health checks route around it.
    """
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("stopping", extra={"signal": signal.Signals(signum).name})
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)

    code = 0
    reported: set[str] = set()
    try:
        stack.start()
        info = stack.ready_info()
        print(banner(info), flush=True)
        if ready_file is not None:
            tmp = ready_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(info, indent=2))
            tmp.replace(ready_file)
        while not stop.wait(POLL_SECONDS):
            for proc in stack.processes:
                if proc.alive or proc.name in reported:
                    continue
                reported.add(proc.name)
                log.error(
                    "child exited",
                    extra={"child": proc.name, "pid": proc.pid, "code": proc.returncode},
                )
                if proc not in stack.pod_processes:
                    code = 1
                    stop.set()
    finally:
        stack.stop()
        if ready_file is not None:
            ready_file.unlink(missing_ok=True)
    return code
