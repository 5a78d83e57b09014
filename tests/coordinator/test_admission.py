"""The admission middleware on a real uvicorn server: 429 at the limit, cancellation on disconnect and abort."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
import uvicorn
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from coordinator import inflight
from coordinator.admission import AdmissionMiddleware
from coordinator.inflight import InflightRegistry
from coordinator.metrics import CoordinatorMetrics
from services.runtime.server import free_port
from tests.support.asgi_server import served_app


class App:
    def __init__(self) -> None:
        self.registry = InflightRegistry()
        self.closed: list[str] = []

    async def generate(self, request: Request):
        body = json.loads(await request.body())
        request_id = request.headers["x-request-id"]
        inflight.bind(request_id + "-internal", request_id)
        inflight.on_close(lambda: self.closed.append(request_id))
        if body.get("stream"):
            async def events():
                for i in range(1000):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.01)
            return StreamingResponse(events(), media_type="text/event-stream")
        await asyncio.sleep(body.get("sleep", 0))
        return JSONResponse({"ok": True})

    async def other(self, _: Request):
        return JSONResponse({"other": True})

    def build(self) -> Starlette:
        admission = Middleware(AdmissionMiddleware, registry=self.registry, max_inflight=2,
                               metrics=CoordinatorMetrics(CollectorRegistry()))
        return Starlette(routes=[Route("/v1/chat/completions", self.generate, methods=["POST"]),
                                 Route("/other", self.other, methods=["POST"])], middleware=[admission])


@pytest.fixture(scope="module")
def served():
    app = App()
    with served_app(app.build()) as url:
        yield app, url


def _post(url: str, request_id: str, body: dict, timeout: float = 10) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json=body, headers={"x-request-id": request_id},
                      timeout=timeout)


def _until(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_beyond_the_limit_requests_get_429_with_retry_after_at_once(served):
    app, url = served
    threads = [threading.Thread(target=_post, args=(url, f"hold{i}", {"sleep": 1.0})) for i in range(2)]
    for t in threads:
        t.start()
    assert _until(lambda: len(app.registry) == 2)
    started = time.monotonic()
    reply = _post(url, "extra", {})
    assert reply.status_code == 429 and reply.headers["retry-after"] == "1"
    assert reply.json()["error"]["type"] == "rate_limit_error"
    assert time.monotonic() - started < 0.5
    assert httpx.post(url + "/other", timeout=5).status_code == 200  # other paths are not limited
    for t in threads:
        t.join()


def test_a_client_that_disconnects_cancels_its_request_and_cleanups_run(served):
    app, url = served
    with pytest.raises(httpx.ReadTimeout):
        _post(url, "leaver", {"sleep": 30}, timeout=0.5)
    assert _until(lambda: "leaver" in app.closed, 2.0)
    assert _until(lambda: len(app.registry) == 0, 2.0)


def test_a_client_that_leaves_a_stream_cancels_it_and_cleanups_run(served):
    """The app streams on ASGI 2.4's contract (no disconnect listener of its own): the middleware's watcher is
    what notices the client going away mid-stream, and it cancels the stream."""
    app, url = served
    with httpx.stream("POST", url + "/v1/chat/completions", json={"stream": True}, timeout=10,
                      headers={"x-request-id": "stream-leaver"}) as reply:
        lines = reply.iter_lines()
        assert next(lines) == "data: 0"
    assert _until(lambda: "stream-leaver" in app.closed, 2.0)  # 1000 events x 10 ms: it did not run to its end
    assert _until(lambda: len(app.registry) == 0, 2.0)


def test_abort_by_id_answers_499_to_the_waiting_client(served):
    app, url = served
    answer = {}
    thread = threading.Thread(target=lambda: answer.update(reply=_post(url, "victim", {"sleep": 30})))
    thread.start()
    assert _until(lambda: app.registry.abort(["victim"]) == 1)
    thread.join(5)
    assert answer["reply"].status_code == 499
    assert answer["reply"].json()["error"]["code"] == "aborted"
    assert _until(lambda: "victim" in app.closed, 2.0)  # the cleanup runs right after the 499 is sent


def test_an_aborted_stream_ends_with_an_error_event(served):
    app, url = served
    lines: list[str] = []

    def consume():
        with httpx.stream("POST", url + "/v1/chat/completions", json={"stream": True}, timeout=10,
                          headers={"x-request-id": "streamer"}) as reply:
            lines.extend(line for line in reply.iter_lines() if line)

    thread = threading.Thread(target=consume)
    thread.start()
    assert _until(lambda: app.registry.abort(["streamer"]) == 1)
    thread.join(5)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == "aborted"


def test_aborts_follow_the_api_key():
    """Labels are not unique: an abort by a tenant's key reaches only that key's requests, the admin's all."""
    from coordinator.inflight import InflightRegistry
    from services.edge.auth import ADMIN

    registry = InflightRegistry()

    async def run():
        records = []
        for key in ("key-a", "key-b", "key-b"):
            record = registry.open("/v1/chat/completions")
            record.task = asyncio.ensure_future(asyncio.sleep(60))
            registry.bind(record, f"same-{len(records)}", "same", key)
            records.append(record)
        assert registry.abort(["same"], "key-c") == 0
        assert registry.abort(["same"], "key-a") == 1
        assert [r.cancel_reason for r in records] == ["abort", None, None]
        assert registry.abort(["same"], ADMIN) == 2
        await asyncio.gather(*(r.task for r in records), return_exceptions=True)

    asyncio.run(run())


def test_a_client_that_stops_reading_a_stream_is_cut_after_the_stall_bound():
    """A real server and a real socket that never reads: the write blocks, the request is cancelled."""
    import socket

    closed: list[str] = []
    registry = InflightRegistry()

    async def endless(request: Request):
        inflight.bind("reader-internal", "reader")
        inflight.on_close(lambda: closed.append("reader"))

        async def events():
            chunk = "data: " + "x" * 65536 + "\n\n"
            while True:
                yield chunk
                await asyncio.sleep(0)
        return StreamingResponse(events(), media_type="text/event-stream")

    admission = Middleware(AdmissionMiddleware, registry=registry, max_inflight=4, send_stall_s=1.0,
                           metrics=CoordinatorMetrics(CollectorRegistry()))
    app = Starlette(routes=[Route("/v1/chat/completions", endless, methods=["POST"])], middleware=[admission])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    assert _until(lambda: server.started, 10)
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        client.connect(("127.0.0.1", port))
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        started = time.monotonic()
        assert _until(lambda: closed == ["reader"], 10.0)  # never read a byte: cut, its cleanups ran
        assert 1.0 <= time.monotonic() - started < 6.0
        assert _until(lambda: len(registry) == 0, 2.0)
    finally:
        client.close()
        server.should_exit = True
        thread.join(5)


@pytest.mark.parametrize("media_type", [b"text/event-stream", b"application/json"])
def test_an_event_streams_head_goes_out_with_its_first_event_and_any_other_head_at_once(media_type):
    """One write pair for the head and the first event of a stream: the client wakes once for both (the first
    token's time), instead of once for the head while the event is still being made."""
    sent: list[dict] = []

    async def main() -> list[str]:
        made = asyncio.Event()

        async def app(scope, receive, send):
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", media_type)]})
            await made.wait()   # the first event is still being made
            await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def receive():
            await asyncio.sleep(3600)

        async def send(message):
            sent.append(message)

        middleware = AdmissionMiddleware(app, registry=InflightRegistry(), max_inflight=2,
                                         metrics=CoordinatorMetrics(CollectorRegistry()))
        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
        running = asyncio.create_task(middleware(scope, receive, send))
        for _ in range(5):
            await asyncio.sleep(0)
        held = [m["type"] for m in sent]
        made.set()
        await asyncio.wait_for(running, 5)
        return held

    held = asyncio.run(main())
    assert held == ([] if media_type == b"text/event-stream" else ["http.response.start"])
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body", "http.response.body"]
    assert sent[0]["status"] == 200 and sent[1]["body"] == b"data: 1\n\n"
