"""The coordinator's HTTP entry (coordinator/http_io.py): bounded, timed body reads, JSON objects only, stream
flags type-checked, and every error of a generation route mapped once to its status, body and counters; real
requests through a real uvicorn server."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from coordinator.http_io import BodyLimits, answer, read_json, stream_flags
from coordinator.metrics import CoordinatorMetrics
from services.protocol.errors import InvalidRequest
from tests.support.asgi_server import served_app

LIMITS = BodyLimits(max_bytes=1024, timeout_s=0.5)


def _app(metrics: CoordinatorMetrics) -> Starlette:
    async def echo(request: Request):
        async def produce():
            raw, body = await read_json(request, LIMITS)
            return JSONResponse({"bytes": len(raw), "keys": sorted(body), "flags": stream_flags(body)})
        return await answer(metrics, "/echo", produce)

    return Starlette(routes=[Route("/echo", echo, methods=["POST"])])


@pytest.fixture
def served():
    metrics = CoordinatorMetrics(CollectorRegistry())
    with served_app(_app(metrics)) as url:
        yield url, metrics


def _counted(metrics: CoordinatorMetrics) -> dict[tuple[str, str], float]:
    return {(s.labels["endpoint"], s.labels["code"]): s.value for s in metrics.errors.collect()[0].samples
            if s.name.endswith("_total")}


def test_a_json_object_is_read_and_its_flags_taken(served):
    url, _ = served
    reply = httpx.post(url + "/echo", json={"stream": True, "stream_options": {"include_usage": True}})
    assert reply.status_code == 200 and reply.json() == {"bytes": 55, "keys": ["stream", "stream_options"],
                                                         "flags": [True, True]}


@pytest.mark.parametrize(("body", "status", "code"), [
    (b"[1, 2]", 400, "invalid_json"),
    (b"{not json", 400, "invalid_json"),
    (json.dumps({"stream": "yes"}).encode(), 400, "invalid_type"),
    (json.dumps({"stream_options": [1]}).encode(), 400, "invalid_type"),
    (b"{" + b'"a": "' + b"x" * 2000 + b'"}', 413, "body_too_large"),
])
def test_bad_bodies_get_a_4xx_naming_the_problem_and_are_counted(served, body, status, code):
    url, metrics = served
    reply = httpx.post(url + "/echo", content=body, headers={"content-type": "application/json"})
    assert reply.status_code == status and reply.json()["error"]["code"] == code
    assert _counted(metrics) == {("/echo", code): 1.0}


def test_a_declared_oversized_body_is_refused_before_it_is_read(served):
    url, _ = served

    async def main() -> tuple[int, bytes]:
        reader, writer = await asyncio.open_connection(*url.removeprefix("http://").split(":"))
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 999999\r\n\r\n{")   # 999,998 bytes never sent
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        writer.close()
        return int(head.split(b" ")[1]), head

    status, _ = asyncio.run(main())
    assert status == 413


def test_a_trickled_body_is_cut_with_408(served):
    url, _ = served

    async def main() -> int:
        reader, writer = await asyncio.open_connection(*url.removeprefix("http://").split(":"))
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 10\r\n\r\n{")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)   # well before the 10 bytes come
        writer.close()
        return int(head.split(b" ")[1])

    assert asyncio.run(main()) == 408


def test_stream_flags_default_off():
    assert stream_flags({}) == (False, False) and stream_flags({"stream": None}) == (False, False)
    with pytest.raises(InvalidRequest):
        stream_flags({"stream": 1})
