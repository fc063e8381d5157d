"""The executor (tools/procs.py): free ports, and children stopped with what they spawned."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.eventually import eventually
from tools import procs
from tools.procs import Process, free_port


def test_free_ports_are_below_the_ephemeral_range_and_never_handed_out_twice() -> None:
    """A source port of any outgoing connection comes from the ephemeral range: a listening
    port chosen there could be taken between its choice and its child's bind."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(p < ephemeral_low for p in ports)
    with socket.socket() as s:  # each is bindable
        s.bind(("127.0.0.1", ports[-1]))


# Another process (a second test suite) that leases ports as free_port does, prints them and
# waits, its children not started yet: nothing listens on them.
LEASER = """
import sys
from tools import procs
procs.random.seed(int(sys.argv[1]))
print(" ".join(str(procs.free_port()) for _ in range(300)), flush=True)
sys.stdin.read()
"""


def test_ports_another_process_handed_out_are_never_handed_out_here() -> None:
    """Until its child binds it, a port another process chose is free to bind: only its lease
    keeps this process from choosing it too (two suites side by side: a child found its port
    taken). The same random choices here as there: without the lease, all 300 would repeat."""
    root = Path(__file__).resolve().parents[2]
    other = subprocess.Popen(
        [sys.executable, "-c", LEASER, "7"],
        cwd=root,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert other.stdout is not None
        theirs = set(map(int, other.stdout.readline().split()))
        assert len(theirs) == 300
        procs.random.seed(7)
        ours = {free_port() for _ in range(300)}
        assert not ours & theirs
    finally:
        other.kill()
        other.wait()
        for stream in (other.stdin, other.stdout):
            if stream is not None:
                stream.close()


# A child that forks a grandchild deaf to SIGTERM (as vLLM's API server spawns its EngineCore),
# writes the grandchild's pid, then waits.
FORKS = 'sh -c \'trap "" TERM; exec sleep 600\' & echo $! > "$0.tmp"; mv "$0.tmp" "$0"; wait'


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:  # a zombie is dead, only not yet reaped
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("how", ["stop", "kill", "child killed, then stop"])
def test_a_child_goes_with_what_it_spawned(tmp_path: Path, how: str) -> None:
    pid_file = tmp_path / "grandchild.pid"
    proc = Process("forks", ["sh", "-c", FORKS, str(pid_file)], pid_file.exists, tmp_path / "log")
    proc.start(30)
    grandchild = int(pid_file.read_text())
    assert pid_alive(grandchild)
    if how == "stop":
        proc.stop(timeout=0.5)
    elif how == "kill":
        proc.kill()
    else:  # the supervisor's case: the child died first, and is renewed (stopped) after
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
        eventually(lambda: not proc.alive, 10, "the child to die")
        proc.stop(timeout=0.5)
    eventually(lambda: not pid_alive(grandchild), 10, "the grandchild to die")
