"""services.runtime.server.free_port: the ports `epd serve` hands its children before they bind them."""

from __future__ import annotations

import socket

from services.runtime.server import _ephemeral_low, free_port


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


def test_another_process_does_not_hand_out_the_ports_this_one_did():
    """Two `epd serve` starting at once pick their children's ports at the same moment, before any child
    binds one: the claim files keep them apart (CI saw two clusters share a port)."""
    import json
    import subprocess
    import sys

    mine = {free_port() for _ in range(150)}
    out = subprocess.run([sys.executable, "-c", "import json; from services.runtime.server import free_port; "
                          "print(json.dumps([free_port() for _ in range(150)]))"],
                         capture_output=True, text=True, timeout=120, check=True)
    theirs = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert len(theirs) == 150 and not mine & theirs


def test_a_second_grpc_server_cannot_bind_a_port_a_role_holds():
    """gRPC's default SO_REUSEPORT would let two roles bind one port and split the calls between them;
    a role's server options turn it off, so the second bind fails."""
    import asyncio

    import grpc
    import pytest

    from services.runtime.server import SERVER_OPTIONS

    async def bind_twice() -> None:
        first = grpc.aio.server(options=SERVER_OPTIONS)
        port = first.add_insecure_port("127.0.0.1:0")
        await first.start()
        try:
            second = grpc.aio.server(options=SERVER_OPTIONS)
            with pytest.raises(RuntimeError):
                second.add_insecure_port(f"127.0.0.1:{port}")
        finally:
            await first.stop(None)

    asyncio.run(bind_twice())
