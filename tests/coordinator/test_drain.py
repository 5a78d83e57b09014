"""Graceful shutdown (coordinator/drain.py): the drain refuses new generation requests 503 `shutting_down`,
waits for running ones within the grace, then stops; everything else passes while it drains."""

from __future__ import annotations

import asyncio
import json

import pytest

from coordinator.drain import Drain, DrainMiddleware
from coordinator.inflight import InflightRegistry


async def _call(app, path: str) -> tuple[int, dict]:
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    await app({"type": "http", "path": path, "method": "POST"}, None, send)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body) if body else {}


async def _inner(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def test_draining_refuses_generation_requests_only():
    drain = Drain(InflightRegistry(), grace_s=1.0)
    app = DrainMiddleware(_inner, drain)

    async def main():
        before = await _call(app, "/v1/chat/completions")
        drain.draining = True
        return before, await _call(app, "/v1/chat/completions"), await _call(app, "/v1/models")

    before, refused, other = asyncio.run(main())
    assert before[0] == 200 and other[0] == 200
    assert refused[0] == 503 and refused[1]["error"]["code"] == "shutting_down"


@pytest.mark.parametrize(("finishes", "stops_after"), [(True, 0.2), (False, 0.6)])
def test_the_drain_waits_for_running_requests_within_the_grace(finishes, stops_after):
    registry = InflightRegistry()
    drain = Drain(registry, grace_s=0.6)

    async def main() -> float:
        record = registry.open("/v1/chat/completions")
        stopped = asyncio.get_running_loop().create_future()
        runner = asyncio.ensure_future(drain.run(lambda: stopped.set_result(asyncio.get_running_loop().time())))
        drain.requested = True
        started = asyncio.get_running_loop().time()
        if finishes:
            await asyncio.sleep(0.2)
            registry.discard(record)
        took = await asyncio.wait_for(stopped, 5) - started
        await runner
        return took

    took = asyncio.run(main())
    assert drain.draining and stops_after - 0.05 <= took <= stops_after + 0.5
