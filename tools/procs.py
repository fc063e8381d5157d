"""Process executor: start a child, wait until it answers at the protocol level, stop it.

Shared by the launcher (`llmgw up`) and the test fixtures. Every child runs under
`setpriv --pdeathsig TERM` (util-linux), so even a launcher killed with SIGKILL leaves no orphan
behind. Not a `preexec_fn`: that forces a plain fork() of a process that may hold gRPC threads,
whose fork handlers then deadlock the parent (seen here); without it Python spawns by vfork.
Every child leads a process group of its own, and is stopped as a group: what it spawned (vLLM's
EngineCore, 1.2 GB) goes with it, even when the child itself was killed first.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

# The probes live beside the image's health check, which runs without the tools.
from llmgw.health import grpc_serving as grpc_serving
from llmgw.health import http_ok as http_ok
from llmgw.resp import encode


class StartError(RuntimeError):
    """A child exited or never became ready; the message carries its log tail."""


# Listening ports are chosen below the kernel's ephemeral range (Linux: 32768-60999). A port
# the kernel hands out for bind(0) is free only until the child binds it, and in between any
# process's outgoing connection may take it as its source port: with a second test suite
# beside this one, children failed to bind. Below the range, only another listener can: another
# process of ours that chose the same port and has not started its child yet (a second suite's
# extauthz found its metrics port taken). So each port handed out is leased, across processes,
# by an flock on a file of its name that this process holds until LEASES later ones (long
# bound by their children by then, or given up).
_LISTEN_PORTS = range(20000, 32768)
_LEASE_DIR = Path(tempfile.gettempdir()) / f"llmgw-ports-{os.getuid()}"
LEASES = 1024
_leases: deque[BinaryIO] = deque()


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` nobody listens on, not handed out lately by this process or another."""
    for _ in range(100):  # a bound, not a speed: nearly every try succeeds
        port = random.choice(_LISTEN_PORTS)
        if not _lease(port):
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue  # leased (as long as its listener lives, nobody else will try it)
        return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@atexit.register
def _release_leases() -> None:
    while _leases:
        _leases.popleft().close()


def _lease(port: int) -> bool:
    """The port's lease taken by this process; False: this process or another holds it."""
    _LEASE_DIR.mkdir(exist_ok=True)
    lease = (_LEASE_DIR / str(port)).open("ab")
    try:
        fcntl.flock(lease, fcntl.LOCK_EX | fcntl.LOCK_NB)  # not re-entrant: ours is refused too
    except OSError:
        lease.close()
        return False
    _leases.append(lease)
    if len(_leases) > LEASES:
        _leases.popleft().close()  # closing the file releases the lock
    return True


def bin_path(name: str) -> str:
    """A binary installed in this interpreter's environment (envoy, redis-server)."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    raise FileNotFoundError(f"{name} not found beside {sys.executable}: run `make install`")


def _with_parent(argv: Sequence[str]) -> list[str]:
    """argv, run so that the child gets SIGTERM when the thread that started it dies."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        raise FileNotFoundError("setpriv not found: install util-linux")
    return [setpriv, "--pdeathsig", "TERM", "--", *argv]


# Readiness probes: each returns True once the child answers.


def open_log(path: Path) -> BinaryIO:
    """A child's log, for appending; owner-only (0600) when created, whatever the umask: logs
    name tenants, sessions and key IDs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")


def tcp_open(host: str, port: int) -> Callable[[], bool]:
    def probe() -> bool:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            return False

    return probe


def redis_ping(host: str, port: int, password: str | None = None) -> Callable[[], bool]:
    """PONG to PING; with a password, after AUTH with it. Not NOAUTH as "up": ready means a
    client holding the stack's password can use this server (a Redis left on the port by another
    run, with another password, is not ready)."""
    command = (encode(("AUTH", password)) if password is not None else b"") + b"PING\r\n"
    expected = (b"+OK\r\n" if password is not None else b"") + b"+PONG\r\n"

    def probe() -> bool:
        try:
            with socket.create_connection((host, port), timeout=0.5) as s:
                s.sendall(command)
                reply = b""
                while len(reply) < len(expected) and not reply.startswith(b"-"):
                    chunk = s.recv(64)
                    if not chunk:
                        break
                    reply += chunk
                return reply == expected
        except OSError:
            return False

    return probe


class Process:
    """One child process with a log file and a readiness probe."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        ready: Callable[[], bool],
        log_path: Path,
        env: Mapping[str, str] | None = None,
        start_timeout: float = 30.0,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.ready = ready
        self.log_path = log_path
        self.env = dict(os.environ if env is None else env)
        # How long it may take to become ready, each time it starts (a real vLLM pod: minutes).
        self.start_timeout = start_timeout
        self.popen: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    @property
    def returncode(self) -> int | None:
        return self.popen.poll() if self.popen else None

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def fresh(self) -> Process:
        """A new, unstarted Process for the same child: argv, env, probe, log file, timeout."""
        return Process(
            self.name, self.argv, self.ready, self.log_path, self.env, self.start_timeout
        )

    def spawn(self) -> Process:
        """Start the child without waiting for it (see `wait_ready`)."""
        with open_log(self.log_path) as log:
            self.popen = subprocess.Popen(
                _with_parent(self.argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,  # its process group is its pid: see `_signal_group`
            )
        return self

    def wait_ready(self, timeout: float | None = None) -> Process:
        """Until the probe answers, at most `timeout` (default: the child's `start_timeout`)."""
        timeout = self.start_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        delay = 0.02
        while time.monotonic() < deadline:
            if not self.alive:
                raise StartError(
                    f"{self.name} exited with code {self.returncode}:\n{self.log_tail()}"
                )
            if self.ready():
                return self
            time.sleep(delay)
            delay = min(delay * 1.5, 0.25)
        self.stop()
        raise StartError(f"{self.name} not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def start(self, timeout: float | None = None) -> Process:
        return self.spawn().wait_ready(timeout)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM to the child's process group, then SIGKILL to whatever of it is left after
        `timeout`; returns the child's exit code."""
        if self.popen is None:
            return None
        deadline = time.monotonic() + timeout
        self._signal_group(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)
        while self._group_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.kill()
        return self.popen.returncode

    def kill(self) -> None:
        """SIGKILL to the child's process group."""
        if self.popen is not None:
            self._signal_group(signal.SIGKILL)
            self.popen.wait()

    def _signal_group(self, sig: signal.Signals) -> None:
        """`sig` to every process left in the child's group, the child or not (a child that
        died first leaves its children there)."""
        assert self.popen is not None
        with contextlib.suppress(ProcessLookupError):  # the group is empty
            os.killpg(self.popen.pid, sig)

    def _group_alive(self) -> bool:
        assert self.popen is not None
        try:
            os.killpg(self.popen.pid, 0)
        except ProcessLookupError:
            return False
        return True


def stop_all(processes: Sequence[Process], timeout: float = 10.0) -> None:
    """Stop in reverse start order, so the proxy goes before what it fronts."""
    for proc in reversed(processes):
        with contextlib.suppress(OSError):
            proc.stop(timeout)
