"""services.server.free_port: the ports `epd serve` hands its children before they bind them."""

from __future__ import annotations

import socket

from services.server import _ephemeral_low, free_port


def test_ports_come_from_below_the_ephemeral_range_once_each_and_bind():
    """An outgoing connection's local port comes from the ephemeral range; a port handed out from there can be
    taken before the child binds it (the suite saw "Address already in use").  Below it, once each."""
    low = _ephemeral_low()
    ports = [free_port() for _ in range(40)]
    assert len(set(ports)) == len(ports)
    if low >= 11000:
        assert all(10000 <= p < low for p in ports), ports
    for port in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_something_listens_on_is_not_handed_out():
    """Every 24th port of the range is taken by a listener opened here (not through free_port): 200 ports
    handed out afterwards miss them all (without the bind check ~8 of them would land on one)."""
    low = _ephemeral_low()
    listeners = []
    try:
        for port in range(max(10000, low - 12000), low, 24):
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            s.listen()
            listeners.append(s)
        taken = {s.getsockname()[1] for s in listeners}
        assert len(taken) > 400 or low < 11000
        assert not taken & {free_port() for _ in range(200)}
    finally:
        for s in listeners:
            s.close()
