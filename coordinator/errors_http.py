"""Starlette's own errors (no such route, wrong method) in the one error shape, for the coordinator's apps.

Without these a request for an unknown path gets Starlette's plain-text
"Not Found"; every answer of the coordinator is `{"error": {"message",
"type", "code"}}` instead, including the 404 the public port gives for the
admin routes (admin.py).
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

_KINDS = {404: ("not_found_error", "route_not_found"), 405: ("invalid_request_error", "method_not_allowed")}


async def http_error(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    kind, code = _KINDS.get(status, ("invalid_request_error", "http_error"))
    message = (f"no route {request.method} {request.url.path} on this port" if status in _KINDS
               else str(getattr(exc, "detail", "error")))
    headers = getattr(exc, "headers", None) if isinstance(exc, HTTPException) else None
    return JSONResponse({"error": {"message": message, "type": kind, "code": code}}, status_code=status,
                        headers=headers)


JSON_ERRORS = {404: http_error, 405: http_error}
