"""Fetch client media bytes (data:, http(s):, and file: when explicitly enabled) under a MediaPolicy.

Threat model: the URL is hostile.  Every http(s) hop is checked by `media_policy` before any
connection; a host name is resolved exactly once, every address it resolves to must pass, and the
connection goes to those checked addresses only: the session's resolver (`PinnedResolver`) answers
from the addresses this request checked and refuses anything else, so DNS rebinding between check
and connect is impossible; the Host header and TLS SNI/certificate checks keep the original name.
Redirects are followed by hand, each hop re-checked.  One deadline covers the whole fetch; bodies
are read in chunks and cut at `max_bytes`.  Responses are never decompressed (no zip bombs), never
sent through proxies from the environment, and no cookies are kept.

Called by: render's request path (services/render/multimodal.py).  Errors are `InvalidRequest` with codes
media_url_forbidden, invalid_media_url, invalid_data_url, media_too_large, media_fetch_failed,
media_fetch_timeout.
"""

from __future__ import annotations

import asyncio
import binascii
import os
import re
import socket
import ssl
import stat
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from yarl import URL

from services.protocol.b64 import b64decode_strict
from services.protocol.errors import InvalidRequest
from services.render.media_policy import (
    INVALID_URL,
    MediaPolicy,
    check_address,
    check_http_target,
    check_scheme,
    describe,
    literal_ip,
)

TOO_LARGE = "media_too_large"
FETCH_FAILED = "media_fetch_failed"
_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*):")
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_CHUNK = 64 * 1024


@dataclass(frozen=True)
class _Pin:
    """The addresses one request checked for one host: all its connection may use."""

    host: str
    addresses: tuple[tuple[int, str], ...]  # (family, address)


# Request-scoped: set around each hop, read by PinnedResolver inside the same task.
_PIN: ContextVar[_Pin | None] = ContextVar("epd_media_pin", default=None)


class PinnedResolver(AbstractResolver):
    """Answers only with the addresses the current request checked; never does DNS itself."""

    async def resolve(self, host: str, port: int = 0, family: int = socket.AF_INET) -> list[ResolveResult]:
        pin = _PIN.get()
        if pin is None or pin.host != host:
            raise OSError(f"host {host!r} was not checked by the media policy")
        flags = socket.AI_NUMERICHOST | socket.AI_NUMERICSERV
        return [ResolveResult(hostname=host, host=addr, port=port, family=fam, proto=0, flags=flags)
                for fam, addr in pin.addresses]

    async def close(self) -> None:
        return None


class MediaConnector(aiohttp.TCPConnector):
    """A connector bound to one policy; its pool only ever holds connections that policy checked."""

    def __init__(self, policy: MediaPolicy, ssl_context: ssl.SSLContext | None = None) -> None:
        super().__init__(resolver=PinnedResolver(), use_dns_cache=False, ssl=ssl_context or True)
        self.policy = policy


def create_media_session(
    policy: MediaPolicy, ssl_context: ssl.SSLContext | None = None
) -> aiohttp.ClientSession:
    """A session for `fetch_media` under `policy` (call inside a running loop; close it when done).

    ssl_context: for a private CA (in-cluster media); certificates are still checked against the URL host.
    """
    return aiohttp.ClientSession(
        connector=MediaConnector(policy, ssl_context),
        cookie_jar=aiohttp.DummyCookieJar(),
        trust_env=False,
        auto_decompress=False,
        timeout=aiohttp.ClientTimeout(total=None),
        headers={"Accept-Encoding": "identity", "User-Agent": "epd-render"},
    )


async def fetch_media(url: str, policy: MediaPolicy, session: aiohttp.ClientSession | None = None) -> bytes:
    """The bytes behind a media URL, or InvalidRequest.

    session: one from `create_media_session(policy)` to reuse connections; None opens a private one.
    """
    url = url.strip()
    match = _SCHEME.match(url)
    if match is None:
        raise InvalidRequest("media URL has no scheme (expected http(s): or data:)", code=INVALID_URL)
    scheme = match.group(1).lower()
    check_scheme(scheme, policy)
    if scheme == "data":  # SIMD base64 (services/protocol/b64.py): only a very long URL goes to a thread
        return decode_data_url(url, policy) if len(url) <= OFF_LOOP_CHARS else \
            await asyncio.to_thread(decode_data_url, url, policy)
    if scheme == "file":
        return await asyncio.to_thread(_read_file, _parse_url(url), policy)
    if session is None:
        async with create_media_session(policy) as own:
            return await _fetch_http(_parse_url(url), policy, own)
    _require_media_session(session, policy)
    return await _fetch_http(_parse_url(url), policy, session)


def _require_media_session(session: aiohttp.ClientSession, policy: MediaPolicy) -> None:
    connector = session.connector
    if not isinstance(connector, MediaConnector) or connector.policy != policy:
        # A plain session would do its own DNS lookup after our check: refuse it, loudly.
        raise ValueError("fetch_media needs a session from create_media_session(policy) for this policy")


def _parse_url(url: str) -> URL:
    try:
        parsed = URL(url)
    except ValueError as exc:
        raise InvalidRequest(f"media URL is malformed: {exc}", code=INVALID_URL) from None
    if not parsed.absolute and parsed.scheme != "file":
        raise InvalidRequest("media URL has no host", code=INVALID_URL)
    return parsed


OFF_LOOP_CHARS = 4 << 20   # a data URL longer than this is decoded in a thread (~0.15 ms per 4 MiB here)


def decode_data_url(url: str, policy: MediaPolicy) -> bytes:
    """The payload of `data:<mime>[;params];base64,<payload>`; only base64 data URLs are accepted."""
    header, comma, payload = url[len("data:"):].partition(",")
    if not comma or header.rsplit(";", 1)[-1].strip().lower() != "base64":
        raise InvalidRequest("data URL must look like data:<mime>;base64,<payload>", code="invalid_data_url")
    limit = 4 * -(-policy.max_bytes // 3)
    if len(payload) > limit:
        payload = "".join(payload.split())  # lines a client wrapped the base64 in may be what makes it long
        if len(payload) > limit:
            raise InvalidRequest(f"data URL payload exceeds {policy.max_bytes} bytes", code=TOO_LARGE)
    try:
        data = b64decode_strict(payload)
    except (binascii.Error, ValueError):
        # Clients may wrap long base64 in lines: only then is the whitespace taken out (a copy of the URL).
        try:
            data = b64decode_strict("".join(payload.split()))
        except (binascii.Error, ValueError):
            raise InvalidRequest("data URL payload is not valid base64", code="invalid_data_url") from None
    if not data:
        raise InvalidRequest("data URL payload is empty", code="invalid_data_url")
    if len(data) > policy.max_bytes:
        raise InvalidRequest(f"data URL payload exceeds {policy.max_bytes} bytes", code=TOO_LARGE)
    return data


def _read_file(url: URL, policy: MediaPolicy) -> bytes:
    if url.host not in (None, "", "localhost"):
        raise InvalidRequest("file URLs must name a local path", code=INVALID_URL)
    with os.fdopen(_open_regular_file(url.path), "rb") as file:
        data = file.read(policy.max_bytes + 1)
    if len(data) > policy.max_bytes:
        raise InvalidRequest(f"media file exceeds {policy.max_bytes} bytes", code=TOO_LARGE)
    return data


def _open_regular_file(path: str) -> int:
    try:
        # O_NONBLOCK: opening a FIFO must not hang (it is refused below); O_NOFOLLOW: no final symlink.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise InvalidRequest(f"cannot open media file: {exc.strerror}", code=FETCH_FAILED) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise InvalidRequest("media file is not a regular file", code=FETCH_FAILED)
    return fd


async def _fetch_http(url: URL, policy: MediaPolicy, session: aiohttp.ClientSession) -> bytes:
    try:
        async with asyncio.timeout(policy.timeout_s):
            return await _follow(url, policy, session)
    except TimeoutError:
        raise InvalidRequest(f"fetching {describe(url)} took longer than {policy.timeout_s:g} s",
                             code="media_fetch_timeout") from None


async def _follow(url: URL, policy: MediaPolicy, session: aiohttp.ClientSession) -> bytes:
    for hop in range(policy.max_redirects + 1):
        pin = await _checked_pin(url, policy, hop)
        result = await _request(url, pin, policy, session)
        if isinstance(result, bytes):
            return result
        url = result
    raise InvalidRequest(f"media URL redirected more than {policy.max_redirects} times "
                         f"(last to {describe(url)})", code=FETCH_FAILED)


async def _checked_pin(url: URL, policy: MediaPolicy, hop: int) -> _Pin:
    """Run the whole policy on one hop; name the redirect in the error when it is one."""
    try:
        if hop:
            check_scheme(url.scheme, policy, redirect=True)
        ip = check_http_target(url, policy)
        host = url.raw_host or ""
        if ip is not None:
            family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
            return _Pin(host, ((family, str(ip)),))
        return _Pin(host, await _resolve_checked(host, url.port or 0, policy))
    except InvalidRequest as exc:
        if not hop:
            raise
        message = f"redirect {hop} to {describe(url)} refused: {exc.message}"
        raise InvalidRequest(message, code=exc.code) from None


async def _resolve_checked(host: str, port: int, policy: MediaPolicy) -> tuple[tuple[int, str], ...]:
    """Resolve once; every address must pass, or the host is refused (no picking the good one)."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        message = f"cannot resolve media host {host!r}: {exc.strerror or exc}"
        raise InvalidRequest(message, code=FETCH_FAILED) from None
    except UnicodeError as exc:  # the resolver's IDNA step: e.g. a label over 63 characters
        raise InvalidRequest(f"media host {host[:80]!r} is not a valid host name: {exc}",
                             code=FETCH_FAILED) from None
    addresses = tuple(dict.fromkeys((int(fam), str(sockaddr[0])) for fam, _, _, _, sockaddr in infos))
    if not addresses:
        raise InvalidRequest(f"media host {host!r} has no address", code=FETCH_FAILED)
    for _, address in addresses:
        ip = literal_ip(address.split("%", 1)[0])
        assert ip is not None  # getaddrinfo returns numeric addresses
        check_address(ip, policy, host=host.rstrip("."))
    return addresses


async def _request(url: URL, pin: _Pin, policy: MediaPolicy, session: aiohttp.ClientSession) -> bytes | URL:
    """One GET under the pin: the body, or the next URL when redirected."""
    token = _PIN.set(pin)
    try:
        async with session.get(url, allow_redirects=False, proxy=None) as response:
            if response.status in _REDIRECTS:
                return _redirect_target(url, response)
            if not 200 <= response.status < 300:
                raise InvalidRequest(f"media URL {describe(url)} answered HTTP {response.status}",
                                     code=FETCH_FAILED)
            return await _read_body(url, response, policy)
    except aiohttp.ClientError as exc:
        message = f"cannot fetch media URL {describe(url)}: {_brief(exc)}"
        raise InvalidRequest(message, code=FETCH_FAILED) from None
    finally:
        _PIN.reset(token)


def _redirect_target(url: URL, response: aiohttp.ClientResponse) -> URL:
    location = response.headers.get("Location")
    if not location:
        raise InvalidRequest(f"media URL {describe(url)} redirected without a Location", code=FETCH_FAILED)
    try:
        return url.join(URL(location))
    except ValueError:
        message = f"media URL {describe(url)} redirected to a malformed URL"
        raise InvalidRequest(message, code=FETCH_FAILED) from None


async def _read_body(url: URL, response: aiohttp.ClientResponse, policy: MediaPolicy) -> bytes:
    limit = policy.max_bytes
    if response.content_length is not None and response.content_length > limit:
        raise InvalidRequest(f"media at {describe(url)} is {response.content_length} bytes, limit {limit}",
                             code=TOO_LARGE)
    body = bytearray()
    async for chunk in response.content.iter_chunked(_CHUNK):
        body += chunk
        if len(body) > limit:
            raise InvalidRequest(f"media at {describe(url)} exceeds {limit} bytes", code=TOO_LARGE)
    if not body:
        raise InvalidRequest(f"media URL {describe(url)} returned an empty body", code=FETCH_FAILED)
    return bytes(body)


def _brief(exc: Any) -> str:
    """The error class and a short reason; never a response body."""
    text = str(exc)
    return f"{type(exc).__name__}: {text[:160]}" if text else type(exc).__name__
