"""DirectRoutes on a real uvicorn server: the generation POSTs run under the given middleware, straight to their
endpoint; every other request goes through the Starlette app as before."""

from __future__ import annotations

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from coordinator.admission import GENERATION_PATHS
from coordinator.direct import DirectRoutes
from tests.support.asgi_server import served_app


class Tag:
    """A middleware that notes its name for each request it sees."""

    def __init__(self, app, name: str, seen: list[str]) -> None:
        self.app, self.name, self.seen = app, name, seen

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            self.seen.append(f"{self.name} {scope['method']} {scope['path']}")
        await self.app(scope, receive, send)


async def chat(request: Request):
    body = await request.json()
    if body.get("stream"):
        async def events():
            for i in range(3):
                yield f"data: {i}\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")
    return JSONResponse({"echo": body, "path": request.scope["path"]})


async def other(_: Request):
    return JSONResponse({"other": True})


@pytest.fixture(scope="module")
def served():
    seen: list[str] = []
    guards = [Middleware(Tag, name="outer", seen=seen), Middleware(Tag, name="inner", seen=seen)]
    routes = [Route("/v1/chat/completions", chat, methods=["POST"]), Route("/other", other, methods=["POST"])]
    app = Starlette(routes=routes, middleware=[Middleware(Tag, name="starlette", seen=seen)])
    with served_app(DirectRoutes(app, {"/v1/chat/completions": chat}, guards)) as url:
        yield seen, url


def test_a_generation_post_runs_under_the_guards_in_order_and_skips_starlette(served):
    seen, url = served
    seen.clear()
    reply = httpx.post(url + "/v1/chat/completions", json={"n": 1}, timeout=5)
    assert reply.status_code == 200 and reply.json() == {"echo": {"n": 1}, "path": "/v1/chat/completions"}
    assert seen == ["outer POST /v1/chat/completions", "inner POST /v1/chat/completions"]


def test_a_direct_stream_arrives_whole(served):
    _, url = served
    reply = httpx.post(url + "/v1/chat/completions", json={"stream": True}, timeout=5)
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
    assert reply.text == "data: 0\n\ndata: 1\n\ndata: 2\n\n"


def test_other_methods_and_paths_go_through_the_starlette_app(served):
    seen, url = served
    seen.clear()
    assert httpx.get(url + "/v1/chat/completions", timeout=5).status_code == 405   # Starlette's router
    assert httpx.post(url + "/other", timeout=5).json() == {"other": True}
    assert seen == ["starlette GET /v1/chat/completions", "starlette POST /other"]


def test_the_coordinator_serves_exactly_its_generation_posts_directly(coordinator_app):
    built = coordinator_app.build()
    assert isinstance(built, DirectRoutes) and set(built.routes) == GENERATION_PATHS
    assert [type(layer).__name__ for layer in _chain(built._chain)] == ["DrainMiddleware", "AdmissionMiddleware"]


def _chain(layer):
    while hasattr(layer, "app"):
        yield layer
        layer = layer.app
