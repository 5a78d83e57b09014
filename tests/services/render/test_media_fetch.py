"""fetch_media against a real local HTTP(S) server (services/render/media_fetch.py).

Every test that could reach the network runs under `media_net_guard`: any connect to an address
other than 127.0.0.1, or any DNS lookup other than "localhost", is refused and fails the test.
"""

from __future__ import annotations

import asyncio
import base64
import ssl
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from yarl import URL

from services.protocol.errors import InvalidRequest
from services.render.media_fetch import create_media_session, fetch_media
from services.render.media_policy import MediaPolicy

pytestmark = pytest.mark.usefixtures("media_net_guard")

LOCAL = MediaPolicy(allowed_private_networks=("127.0.0.1/32",))


def fetch(url: str, policy: MediaPolicy = LOCAL) -> bytes:
    return asyncio.run(fetch_media(url, policy))


def redirect_to(server: Any, target: str, status: int = 302) -> str:
    return str(URL(server.url("/redirect-to")).with_query(url=target, status=str(status)))


def refused(url: str, policy: MediaPolicy = LOCAL) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        fetch(url, policy)
    assert info.value.status == 400
    return info.value


# --- SSRF: refused before any connection ------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    ["http://10.0.0.1/", "http://192.168.1.1/", "http://169.254.169.254/latest/meta-data/", "http://[::1]/",
     "http://[::ffff:127.0.0.1]/", "http://0.0.0.0/", "http://2130706433/", "http://0177.0.0.1/",
     "http://127.1/", "https://100.64.0.1/", "http://[64:ff9b::a9fe:a9fe]/"],
)
def test_default_policy_refuses_internal_addresses(url: str, media_net_guard, media_server) -> None:
    assert refused(url, MediaPolicy()).code == "media_url_forbidden"
    assert media_net_guard.connects == [] and not media_net_guard.lookups


def test_default_policy_refuses_the_local_server(media_net_guard, media_server) -> None:
    before = sum(media_server.hits.values())
    for host in ("127.0.0.1", "localhost"):
        error = refused(media_server.url("/image/png", host), MediaPolicy())
        assert error.code == "media_url_forbidden" and "loopback" in error.message
    assert media_net_guard.connects == [] and sum(media_server.hits.values()) == before
    assert media_net_guard.lookups == {"localhost": 1}  # resolved to check it, never connected


@pytest.mark.parametrize("url", ["file:///etc/passwd", "FILE:///etc/passwd", "ftp://example.com/x.png",
                                 "gopher://example.com/", "javascript:alert(1)"])
def test_other_schemes_refused(url: str, media_net_guard) -> None:
    assert "not allowed" in refused(url, MediaPolicy()).message
    assert media_net_guard.connects == []


@pytest.mark.parametrize("url", ["example.com/a.png", "//example.com/a.png", "http:///a.png", "", "http://h:99999/"])
def test_malformed_urls(url: str) -> None:
    assert refused(url, MediaPolicy()).code == "invalid_media_url"


def test_domain_list_refuses_local_server_even_with_private_networks(media_net_guard, media_server) -> None:
    policy = MediaPolicy(allowed_domains=("example.com",), allow_private_networks=True)
    assert "allowed domains" in refused(media_server.url("/image/png"), policy).message
    assert media_net_guard.connects == [] and not media_net_guard.lookups


# --- the local server, allowed ------------------------------------------------------------------


def test_allowed_private_network_fetches(media_server, media_images) -> None:
    assert fetch(media_server.url("/image/png")) == media_images["png"]
    lifted = MediaPolicy(allow_private_networks=True)
    assert fetch(media_server.url("/image/jpeg"), lifted) == media_images["jpeg"]


def test_host_name_resolved_once_and_host_header_kept(media_net_guard, media_server) -> None:
    body = fetch(media_server.url("/echo-host", "localhost"))
    assert body.decode() == f"localhost:{media_server.port}"
    assert media_net_guard.lookups == {"localhost": 1}
    assert media_net_guard.connects == ["127.0.0.1"]


def test_session_reuse_and_pinned_resolver(media_net_guard, media_server, media_images) -> None:
    async def main() -> None:
        async with create_media_session(LOCAL) as session:
            for _ in range(3):
                assert await fetch_media(media_server.url("/image/png", "localhost"), LOCAL, session) == \
                    media_images["png"]
            with pytest.raises(ValueError, match="create_media_session"):
                await fetch_media(media_server.url("/image/png"), MediaPolicy(), session)
        async with create_media_session(LOCAL) as fresh:
            # Outside fetch_media nothing was checked, so the session's resolver refuses the host.
            with pytest.raises(aiohttp.ClientConnectorError) as info:
                await fresh.get(media_server.url("/image/png", "localhost"))
            assert "not checked by the media policy" in str(info.value.os_error)
        async with aiohttp.ClientSession() as plain:
            with pytest.raises(ValueError, match="create_media_session"):
                await fetch_media(media_server.url("/image/png"), LOCAL, plain)

    asyncio.run(main())
    assert media_net_guard.lookups == {"localhost": 3}
    assert media_net_guard.connects == ["127.0.0.1"]  # keep-alive: one connection for three fetches


def test_https_keeps_the_name_for_sni_and_certificate(media_tls_server, media_tls_cert, media_images) -> None:
    context = ssl.create_default_context(cafile=media_tls_cert[0])

    async def get(host: str) -> bytes:
        async with create_media_session(LOCAL, context) as session:
            return await fetch_media(media_tls_server.url("/image/png", host, "https"), LOCAL, session)

    assert asyncio.run(get("localhost")) == media_images["png"]
    assert media_tls_server.sni[-1] == "localhost"
    # The certificate names localhost only: by IP the check fails, so verification is really on.
    with pytest.raises(InvalidRequest, match="cannot fetch"):
        asyncio.run(get("127.0.0.1"))


# --- redirects ----------------------------------------------------------------------------------


def test_redirects_followed_within_the_limit(media_server, media_images) -> None:
    assert fetch(media_server.url("/redirect/3")) == media_images["png"]  # 4 hops: 3 redirects
    error = refused(media_server.url("/redirect/4"))
    assert error.code == "media_fetch_failed" and "more than 3" in error.message
    assert refused(media_server.url("/redirect/1"), MediaPolicy(allowed_private_networks=("127.0.0.1/32",),
                                                               max_redirects=0)).code == "media_fetch_failed"


@pytest.mark.parametrize(
    "target",
    ["http://10.1.2.3/", "http://169.254.169.254/latest/meta-data/", "http://[::1]:{port}/image/png",
     "http://2130706433/", "file:///etc/passwd",
     "data:image/png;base64,aGVsbG8=", "ftp://example.com/"],
)
def test_redirect_targets_rechecked(target: str, media_net_guard, media_server) -> None:
    target = target.format(port=media_server.port)
    policy = MediaPolicy(allowed_private_networks=("127.0.0.1/32",), allowed_schemes=("http",))
    error = refused(redirect_to(media_server, target), policy)
    assert error.message.startswith("redirect 1 to ")
    assert media_net_guard.outside() == []


def test_redirect_to_private_address_names_the_redirect(media_net_guard, media_server) -> None:
    for status in (301, 302, 303, 307, 308):
        error = refused(redirect_to(media_server, "http://10.1.2.3/secret", status))
        assert error.code == "media_url_forbidden"
        assert error.message.startswith("redirect 1 to http://10.1.2.3/secret refused")
    assert media_net_guard.connects == ["127.0.0.1"] * 5


def test_redirect_rechecks_the_domain_list(media_net_guard, media_server) -> None:
    policy = MediaPolicy(allowed_domains=("127.0.0.1",), allow_private_networks=True)
    assert fetch(media_server.url("/redirect/1"), policy)
    error = refused(redirect_to(media_server, "http://10.1.2.3/"), policy)
    assert "redirect 1 to http://10.1.2.3/ refused" in error.message and "allowed domains" in error.message


# --- limits and upstream failures --------------------------------------------------------------


@pytest.mark.parametrize("path", ["/big-sized", "/big-chunked"])
def test_byte_limit(path: str, media_server) -> None:
    error = refused(media_server.url(path), MediaPolicy(allow_private_networks=True, max_bytes=1024 * 1024))
    assert error.code == "media_too_large"
    # With a Content-Length the refusal comes from the header, before reading the body.
    assert ("is 2097152 bytes, limit 1048576" in error.message) == (path == "/big-sized")
    assert fetch(media_server.url(path), MediaPolicy(allow_private_networks=True, max_bytes=4 * 1024 * 1024))


@pytest.mark.parametrize("path", ["/slow", "/trickle"])
def test_whole_fetch_timeout(path: str, media_server) -> None:
    started = time.monotonic()
    error = refused(media_server.url(path), MediaPolicy(allow_private_networks=True, timeout_s=0.5))
    assert error.code == "media_fetch_timeout" and time.monotonic() - started < 2.5


@pytest.mark.parametrize("code", [404, 403, 500])
def test_http_errors_name_the_status_not_the_body(code: int, media_server) -> None:
    error = refused(media_server.url(f"/status/{code}"))
    assert error.code == "media_fetch_failed" and f"HTTP {code}" in error.message
    assert "secret" not in error.message


def test_empty_body_and_closed_port(media_server) -> None:
    assert refused(media_server.url("/empty")).code == "media_fetch_failed"
    assert refused("http://127.0.0.1:1/x.png").code == "media_fetch_failed"


# --- data: and file: ------------------------------------------------------------------------------


def test_data_urls(media_images) -> None:
    payload = base64.b64encode(media_images["png"]).decode()
    assert fetch(f"data:image/png;base64,{payload}", MediaPolicy()) == media_images["png"]
    wrapped = "\n".join(payload[i : i + 76] for i in range(0, len(payload), 76))
    assert fetch(f"  DATA:image/png;name=a.png;base64,{wrapped}  ", MediaPolicy()) == media_images["png"]


def test_a_wrapped_data_url_at_the_size_limit_is_taken(media_images) -> None:
    """The limit is on the bytes: the newlines of a wrapped payload do not count against it."""
    data = media_images["png"]
    payload = base64.b64encode(data).decode()
    wrapped = "\r\n".join(payload[i : i + 60] for i in range(0, len(payload), 60))
    assert fetch(f"data:image/png;base64,{wrapped}", MediaPolicy(max_bytes=len(data))) == data
    assert refused(f"data:image/png;base64,{wrapped}", MediaPolicy(max_bytes=len(data) - 3)).code == \
        "media_too_large"


@pytest.mark.parametrize(
    "url, code",
    [("data:image/png;base64,!!!notbase64", "invalid_data_url"),
     ("data:image/png;base64,aGVsbG8", "invalid_data_url"),  # bad padding
     ("data:text/plain,hello", "invalid_data_url"),  # not base64
     ("data:image/png;base64", "invalid_data_url"),
     ("data:image/png;base64,", "invalid_data_url"),
     ("data:image/png;base64," + "A" * 4000, "media_too_large")],
)
def test_bad_data_urls(url: str, code: str) -> None:
    assert refused(url, MediaPolicy(max_bytes=1000)).code == code


def test_data_urls_can_be_disabled() -> None:
    assert refused("data:image/png;base64,aGVsbG8=", MediaPolicy(allowed_schemes=("https",))).code == \
        "media_url_forbidden"


def test_file_urls_only_when_enabled(tmp_path: Path, media_images) -> None:
    image = tmp_path / "a.png"
    image.write_bytes(media_images["png"])
    assert refused(f"file://{image}", MediaPolicy()).code == "media_url_forbidden"
    enabled = MediaPolicy(allow_file_urls=True, max_bytes=len(media_images["png"]))
    assert fetch(f"file://{image}", enabled) == media_images["png"]
    assert refused(f"file://{tmp_path}", enabled).code == "media_fetch_failed"  # a directory
    assert refused(f"file://{tmp_path}/missing.png", enabled).code == "media_fetch_failed"
    tiny = MediaPolicy(allow_file_urls=True, max_bytes=10)
    assert refused(f"file://{image}", tiny).code == "media_too_large"
    (tmp_path / "link.png").symlink_to(image)
    assert refused(f"file://{tmp_path}/link.png", enabled).code == "media_fetch_failed"
