"""The coordinator's private control plane: instance registration and aborts on their own HTTP server.

The public port serves clients (OpenAI and scale-out routes, behind the API
keys); whoever can register an instance receives prompts, pixels and KV
handles, so registration lives apart: a second server on --admin-host /
--admin-port (loopback by default) in the same process and event loop,
serving the control routes (control_api.py) and nothing else.  The public
port answers 404 for them.

Who may call what (AdminAuthMiddleware):

| credential (Authorization: Bearer ...) | may call |
|---|---|
| an --admin-token | every admin route |
| an --api-key (a tenant) | POST /abort_requests, for its own requests only |
| none, when no admin token is set (loopback only: config refuses another host without one) | every admin route |

Role processes announce themselves here (--coordinator-url is this address,
with the first admin token).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from starlette.applications import Starlette

from services.config import EpdConfig
from services.edge.auth import ADMIN, PRINCIPAL_KEY, KeySet, bearer_token, send_error

from .control_api import ControlApi
from .errors_http import JSON_ERRORS
from .inflight import InflightRegistry

log = logging.getLogger(__name__)
TENANT_PATHS = frozenset({"/abort_requests"})  # what an API key (not the admin token) may call here


class AdminAuthMiddleware:
    def __init__(self, app: Any, tokens: KeySet, api_keys: KeySet) -> None:
        self.app, self.tokens, self.api_keys = app, tokens, api_keys

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope)
        tenant = None if token is None else self.api_keys.identify(token)
        if (token is not None and self.tokens.accepts(token)) or (token is None and not self.tokens):
            who = ADMIN
        elif tenant is not None and scope["path"] in TENANT_PATHS:
            who = tenant
        elif tenant is not None:
            await send_error(send, 403, "admin_token_required",
                             f"{scope['path']} on the admin API needs the admin token, not an API key")
            return
        else:
            code = "missing_admin_token" if token is None else "invalid_admin_token"
            await send_error(send, 401, code, "the admin API requires 'Authorization: Bearer <admin token>'")
            return
        await self.app({**scope, PRINCIPAL_KEY: who}, receive, send)


def build_admin_app(config: EpdConfig, cluster: Any, inflight: InflightRegistry) -> Any:
    routes = ControlApi(cluster, inflight).routes()
    log.info("coordinator admin routes: %s", json.dumps([[m, r.path] for r in routes for m in sorted(r.methods or ())
                                                         if m != "HEAD"]))
    app = Starlette(routes=routes, exception_handlers=JSON_ERRORS)
    if not config.security.admin_tokens():
        log.warning("the coordinator admin API on %s has no admin token: any local process may register "
                    "instances (set --admin-token)", config.security.admin_host)
    return AdminAuthMiddleware(app, config.security.admin_tokens(), config.security.api_keys())
