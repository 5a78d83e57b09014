"""services.runtime.launch.readiness: what `epd serve` takes for a child's "ready", over real HTTP."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from services.runtime.launch import readiness


def _server(status: int, body: dict) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:   # noqa: N802 - http.server's name
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *_args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_a_200_counts_only_from_the_instance_serve_started_when_it_names_one():
    ours = _server(200, {"status": "ready", "instance_id": "abc_coordinator"})
    other = _server(200, {"status": "ready", "instance_id": "xyz_coordinator"})
    silent = _server(200, {"status": "ready"})      # a server that is no coordinator of epd's
    try:
        port, other_port, silent_port = (s.server_address[1] for s in (ours, other, silent))
        assert readiness("127.0.0.1", port, "/ready", "abc_coordinator") == (True, [])
        assert readiness("127.0.0.1", other_port, "/ready", "abc_coordinator") == (
            False, [f"port {other_port} answered for another instance ('xyz_coordinator'), not abc_coordinator"])
        assert readiness("127.0.0.1", silent_port, "/ready", "abc_coordinator") == (
            False, [f"port {silent_port} answered for another instance (None), not abc_coordinator"])
        assert readiness("127.0.0.1", silent_port, "/ready") == (True, [])   # a role: its 200 is enough
    finally:
        for server in (ours, other, silent):
            server.shutdown()
            server.server_close()


def test_a_503_gives_its_problems_and_nothing_listening_is_not_ready():
    busy = _server(503, {"status": "not_ready", "problems": ["no ready decode instance (1 known)"]})
    port = busy.server_address[1]
    try:
        assert readiness("127.0.0.1", port, "/ready", "abc_coordinator") == (
            False, ["no ready decode instance (1 known)"])
    finally:
        busy.shutdown()
        busy.server_close()
    assert readiness("127.0.0.1", port, "/ready") == (False, ["not answering yet"])
