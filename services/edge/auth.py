"""API keys: who may call epd's HTTP APIs (one ASGI middleware in front of every route of an app).

Keys come from the configuration (services.config): `--api-key` / EPD_API_KEY
for the coordinator's OpenAI and scale-out API, `--role-api-key` /
EPD_ROLE_API_KEY for each role's HTTP API (default: the same keys).  A value
is a list separated by commas or newlines; an entry `@/path/file` reads one
key per line from a file (a mounted Kubernetes Secret; blank lines and `#`
comments skipped).  The placeholder values of deploy/ are refused.

A request carries `Authorization: Bearer <key>`.  The middleware answers 401
with the OpenAI-style error body (`missing_api_key` / `invalid_api_key`)
before the route runs or any body byte is read.  Protection is by default:
every path is checked except the probe paths an app declares open (`/health`,
readiness, `/metrics`), so a route added later is covered without anyone
remembering it.  Only SHA-256 digests of the keys are kept, compared in
constant time; a key is never logged and a 401 never echoes what was sent.
With no key configured there is no middleware and the process logs once, at
start, that its API is unauthenticated (`warn_if_open`).

Who calls what: services.runtime.server (roles) and the coordinator's app wrap their
Starlette apps with `protect`; services.config validates the values with
`parse_keys` at start-up.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)
MAX_KEY_CHARS = 512
PLACEHOLDER = "REPLACE-ME"  # what deploy/'s Secret holds until someone puts real keys there
Scope = MutableMapping[str, Any]


def parse_keys(value: str, what: str = "api key") -> list[str]:
    """The keys a configuration value names (raises ValueError naming the problem, never a key).

    Entries are separated by commas or newlines (a Secret read as an environment variable holds one key
    per line); an entry "@path" reads a file."""
    keys: list[str] = []
    for entry in (e.strip() for e in value.replace("\n", ",").split(",")):
        if entry.startswith("@"):
            keys.extend(_keys_in_file(entry[1:], what))
        elif entry:
            keys.append(_checked(entry, what))
    return keys


def _keys_in_file(path: str, what: str) -> list[str]:
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            lines = [line.strip() for line in f]
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the {what} file {path}: {type(exc).__name__}") from None
    keys = [_checked(line, what) for line in lines if line and not line.startswith("#")]
    if not keys:
        raise ValueError(f"the {what} file {path} holds no key")
    return keys


def _checked(key: str, what: str) -> str:
    if key.startswith(PLACEHOLDER):
        raise ValueError(f"an {what} is still the placeholder of deploy/ ({PLACEHOLDER}...): put real keys in the "
                         "Secret epd-secrets (docs/security.md)")
    if len(key) > MAX_KEY_CHARS or not all("\x21" <= c <= "\x7e" and c != "," for c in key):
        raise ValueError(f"an {what} must be 1-{MAX_KEY_CHARS} printable ASCII characters without spaces or commas")
    return key


def _digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


@dataclass(frozen=True)
class KeySet:
    """The accepted keys, as digests."""

    digests: tuple[bytes, ...] = ()

    @classmethod
    def of(cls, keys: Iterable[str]) -> KeySet:
        return cls(tuple(_digest(k) for k in keys))

    def __bool__(self) -> bool:
        return bool(self.digests)

    def accepts(self, presented: str | bytes) -> bool:
        return self.identify(presented) is not None

    def identify(self, presented: str | bytes) -> str | None:
        """A stable name of the key that matched ("key-" + 12 hex of its digest: not the key), or None."""
        wanted = _digest(presented)
        found: bytes | None = None
        for digest in self.digests:  # no early exit: the time taken does not depend on which key matched
            if hmac.compare_digest(digest, wanted):
                found = digest
        return None if found is None else "key-" + found.hex()[:12]


def bearer_token(scope: Scope) -> bytes | None:
    """The credential of `Authorization: Bearer <token>`, None when absent or another scheme."""
    for name, value in scope.get("headers") or ():
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            return (token.strip() or None) if scheme.lower() == b"bearer" else None
    return None


def _error(code: str, message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "code": code}}).encode()


def principal(scope: Scope) -> str:
    """Who sent the request, as the middleware found it: a key name, ADMIN, or "" (no keys configured)."""
    return str(scope.get(PRINCIPAL_KEY, ""))


PRINCIPAL_KEY = "epd.principal"
ADMIN = "admin"


async def send_error(send: Any, status: int, code: str, message: str) -> None:
    body = _error(code, message)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class ApiKeyMiddleware:
    """401 for every request without an accepted key, except on `open_paths`; the key's name goes into
    the scope (`principal`), so what a request may touch later (its own aborts) can follow the key."""

    def __init__(self, app: Any, keys: KeySet, open_paths: Iterable[str], what: str = "this API") -> None:
        self.app, self.keys, self.open_paths, self.what = app, keys, frozenset(open_paths), what

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope)
        name = None if token is None else self.keys.identify(token)
        if name is not None:
            await self.app({**scope, PRINCIPAL_KEY: name}, receive, send)
        elif token is None:
            await send_error(send, 401, "missing_api_key",
                             f"{self.what} requires an API key: send 'Authorization: Bearer <key>'")
        else:
            await send_error(send, 401, "invalid_api_key", f"the API key sent is not valid for {self.what}")


def protect(app: Any, keys: KeySet, open_paths: Iterable[str], what: str) -> Any:
    """`app` behind the key check, or `app` itself (with a start-up warning) when no key is configured."""
    if not keys:
        warn_if_open(what)
        return app
    log.info("%s requires an API key (%d accepted)", what, len(keys.digests))
    return ApiKeyMiddleware(app, keys, open_paths, what)


def warn_if_open(what: str) -> None:
    log.warning("%s is unauthenticated: anyone who reaches its port may call it (set --api-key / EPD_API_KEY "
                "or --role-api-key / EPD_ROLE_API_KEY)", what)
