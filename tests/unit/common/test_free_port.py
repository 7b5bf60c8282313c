"""services.common.local.procs.free_port: a port picked for a process to bind later is never one the kernel
hands to `bind(port 0)` in the meantime."""

from __future__ import annotations

import socket

from services.common.local.procs import _ephemeral_range, free_port


def test_free_ports_lie_below_the_ephemeral_range_and_bind():
    lo, _ = _ephemeral_range()
    ports = {free_port() for _ in range(50)}
    assert all(10_000 <= p < lo for p in ports), sorted(ports)
    for port in list(ports)[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_listening_on_0_never_collides_with_a_picked_one():
    picked = {free_port() for _ in range(20)}
    sockets = []
    try:
        for _ in range(200):  # what actors and test servers listening on port 0 get
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        assert not picked & {s.getsockname()[1] for s in sockets}
    finally:
        for s in sockets:
            s.close()
