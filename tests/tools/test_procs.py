"""The executor's free ports (tools/procs.py)."""

from __future__ import annotations

import socket

from tools.procs import free_port


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
