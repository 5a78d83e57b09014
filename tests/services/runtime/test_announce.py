"""What a role instance announces to the coordinator."""

from __future__ import annotations

import itertools
import time

from services.config import EpdConfig
from services.runtime.announce import announcement


def test_announcement_uses_the_advertised_host():
    config = EpdConfig.of(host="0.0.0.0", advertise_host="10.1.2.3")
    assert announcement(config, "prefill", 7001, 8001) == {
        "role": "prefill", "grpc_address": "10.1.2.3:7001", "http_url": "http://10.1.2.3:8001"}


def test_an_ipv6_host_is_bracketed():
    body = announcement(EpdConfig.of(host="fd00::5"), "decode", 1, 2)
    assert body["grpc_address"] == "[fd00::5]:1" and body["http_url"] == "http://[fd00::5]:2"


def test_the_announcer_sends_the_first_admin_token(tmp_path):
    import asyncio

    from services.runtime.announce import start_announcing

    async def started():
        config = EpdConfig.of(coordinator_url="http://127.0.0.1:9", admin_token="tok-new,tok-old")
        announcer = start_announcing(config, "encode", 1, 2)
        assert announcer is not None and announcer._token == "tok-new"
        announcer._task.cancel()

    asyncio.run(started())


class _Coordinator:
    """A real HTTP server counting the announcements it is sent (POST /v1/instances)."""

    def __init__(self, port: int = 0) -> None:
        import http.server
        import threading

        posts = self.posts = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                posts.append((time.monotonic(), body))
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *_):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _announcing(url: str, seconds: float, probe_every: float | None = None) -> None:
    """Run an announcer for `seconds`, a coordinator probe reaching the process every `probe_every` s."""
    import asyncio

    from services.runtime import announce

    async def run():
        announcer = announce.Announcer(url, {"role": "decode", "grpc_address": "127.0.0.1:1", "http_url": ""})
        announcer.start()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if probe_every is not None:
                announce.probed()
            await asyncio.sleep(probe_every or 0.05)
        announcer._task.cancel()

    asyncio.run(run())


def test_an_instance_no_coordinator_probes_announces_again_within_about_a_second():
    # Forgotten while its host was cut off: the coordinator probes it no more, and the instance must not wait for
    # its next periodic announce (10 s) to join again.
    coordinator = _Coordinator()
    try:
        _announcing(f"http://127.0.0.1:{coordinator.port}", 3.4)
        times = [t for t, _ in coordinator.posts]
        assert len(times) in (3, 4), times   # at start, then every 1 s (0.25 s ticks): not once in 10 s
        assert all(0.9 < b - a < 1.6 for a, b in itertools.pairwise(times)), times
    finally:
        coordinator.close()


def test_a_probed_instance_announces_only_at_start_and_every_period():
    coordinator = _Coordinator()
    try:
        _announcing(f"http://127.0.0.1:{coordinator.port}", 2.5, probe_every=0.2)
        assert len(coordinator.posts) == 1, coordinator.posts
    finally:
        coordinator.close()


def test_an_unreachable_coordinator_is_retried_every_quarter_second():
    import socket
    import threading

    with socket.socket() as s:   # a port nothing listens on, until the coordinator starts on it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started: list[_Coordinator] = []
    timer = threading.Timer(1.0, lambda: started.append(_Coordinator(port)))
    timer.start()
    try:
        t0 = time.monotonic()
        _announcing(f"http://127.0.0.1:{port}", 2.0, probe_every=0.2)
        assert started and started[0].posts, "never announced once the coordinator was up"
        assert started[0].posts[0][0] - t0 < 1.0 + 0.25 + 0.2, started[0].posts
    finally:
        timer.cancel()
        for coordinator in started:
            coordinator.close()
