"""The generation routes without Starlette's layers: POST /v1/chat/completions, /v1/completions and
/inference/v1/generate go from the middleware that guards them straight to their endpoint.

Starlette's app adds, to every request it routes: its error middleware (a wrapper around each send), the
exception middleware (another), the router's match of each route in turn, and the route's request/response
wrapper: code a one-image request runs cache-cold on its critical path (docs/benchmarks.md, "Orchestration
overhead after pixels by handle", measures it side by side).  `DirectRoutes` serves those three POST routes
itself:

- the same middleware instances' classes and arguments as the Starlette app's (`CoordinatorApp.middleware`:
  drain, then admission), so a generation request is drained, admitted, cancelled and cleaned up exactly as
  before;
- the same endpoints (`OpenAIApi.chat`, ...): they already map every error to the one error shape
  (`http_io.answer`), so nothing is left for Starlette's exception middlewares to do;
- everything else (other paths, other methods, the lifespan) goes to the Starlette app unchanged, where
  the same routes stay listed (a GET on them is its 405).

An exception that escapes an endpoint's response (a stream failing after its first byte) reaches the
server as it did through Starlette: logged, the connection closed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response

Endpoint = Callable[[Request], Awaitable[Response]]
ASGIApp = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


class DirectRoutes:
    """`app` with `routes` (POST path -> endpoint) served under `middleware` (outermost first) instead."""

    def __init__(self, app: ASGIApp, routes: Mapping[str, Endpoint], middleware: Sequence[Middleware]) -> None:
        self.app, self.routes = app, dict(routes)
        chain: ASGIApp = self._endpoint
        for layer in reversed(middleware):
            chain = layer.cls(chain, *layer.args, **layer.kwargs)
        self._chain = chain

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self.routes:
            await self._chain(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _endpoint(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        response = await self.routes[scope["path"]](Request(scope, receive))
        await response(scope, receive, send)
