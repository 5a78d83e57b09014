"""Fixtures for the media intake tests (test_media_*.py): sample files, a real local HTTP server,
and a network guard that proves refused URLs never reach the network."""

from __future__ import annotations

import asyncio
import io
import os
import socket
import ssl
import struct
import threading
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest
from aiohttp import web
from PIL import Image

BIG_BODY = 2 * 1024 * 1024  # served by /big*; tests use max_bytes=1 MiB


def _save(image: Image.Image, fmt: str, **kwargs: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **kwargs)
    return buffer.getvalue()


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_header_only(width: int, height: int, rows: int = 4) -> bytes:
    """A small PNG whose header declares width x height (8-bit gray), holding `rows` rows of zeros."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    idat = zlib.compress(b"\0" * (width + 1) * rows, 9)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", idat)
            + _png_chunk(b"IEND", b""))


def _sample_images() -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    noise = Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8), "RGB")
    png, jpeg = _save(noise, "PNG"), _save(noise, "JPEG")
    idat = png.find(b"IDAT") + 100
    palette = Image.new("P", (4, 4), 0)
    palette.putpalette([255, 0, 0, 0, 0, 255] + [0] * 762)
    palette.putpixel((0, 0), 1)
    gray16 = Image.fromarray(np.array([[0, 257 * 128, 65535]], dtype=np.uint16))
    return {
        "png": png,
        "jpeg": jpeg,
        "text": b"hello, this is not an image\n",
        "truncated_png": png[: len(png) // 2],
        "truncated_jpeg": jpeg[: len(jpeg) // 2],
        "corrupt_png": png[:idat] + bytes(b ^ 0xFF for b in png[idat : idat + 16]) + png[idat + 16 :],
        "bomb_png": png_header_only(20_000, 20_000),  # over PIL's own limit too
        # A real bomb: 25 Mpx of zeros in ~25 KB; over the default policy, under PIL's own limit.
        "large_png": png_header_only(5_000, 5_000, rows=5_000),
        "tiny_png": _save(Image.new("RGB", (1, 1), (10, 20, 30)), "PNG"),
        "rgba_png": _save(Image.new("RGBA", (2, 2), (255, 0, 0, 0)), "PNG"),
        "la_png": _save(Image.new("LA", (2, 2), (0, 0)), "PNG"),
        "palette_png": _save(palette, "PNG", transparency=0),
        "gray16_png": _save(gray16, "PNG"),
        "bilevel_png": _save(Image.new("1", (8, 8), 1), "PNG"),
        "cmyk_jpeg": _save(Image.new("CMYK", (4, 4), (0, 255, 0, 0)), "JPEG"),
        "gif": _save(palette, "GIF"),
        "webp": _save(noise, "WEBP"),
        "bmp": _save(noise, "BMP"),
        "tiff": _save(noise, "TIFF"),
        "eps": b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n",
    }


@pytest.fixture(scope="session")
def media_images() -> dict[str, bytes]:
    return _sample_images()


@dataclass
class MediaServer:
    """A real aiohttp server on 127.0.0.1 run in its own thread; `hits` counts requests per path."""

    port: int
    hits: Counter[str] = field(default_factory=Counter)
    sni: list[str | None] = field(default_factory=list)

    def url(self, path: str, host: str = "127.0.0.1", scheme: str = "http") -> str:
        return f"{scheme}://{host}:{self.port}{path}"


def _routes(server: MediaServer, images: dict[str, bytes]) -> web.Application:
    async def count(request: web.Request, handler):  # type: ignore[no-untyped-def]
        server.hits[request.path] += 1
        return await handler(request)

    async def image(request: web.Request) -> web.Response:
        return web.Response(body=images[request.match_info["name"]], content_type="application/octet-stream")

    async def redirect(request: web.Request) -> web.Response:
        left = int(request.match_info["n"])
        location = f"/redirect/{left - 1}" if left > 1 else "/image/png"  # /redirect/n: n redirects
        return web.Response(status=302, headers={"Location": location})

    async def redirect_to(request: web.Request) -> web.Response:
        return web.Response(status=int(request.query.get("status", "302")),
                            headers={"Location": request.query["url"]})

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.Response(body=images["png"])

    async def trickle(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for _ in range(50):
            await response.write(b"x")
            await asyncio.sleep(0.1)
        return response

    async def big_sized(request: web.Request) -> web.Response:
        return web.Response(body=b"\0" * BIG_BODY)

    async def big_chunked(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        for _ in range(BIG_BODY // 65536):
            await response.write(b"\0" * 65536)
        return response

    async def echo_host(request: web.Request) -> web.Response:
        return web.Response(text=request.headers.get("Host", ""))

    async def status(request: web.Request) -> web.Response:
        return web.Response(status=int(request.match_info["code"]), text="upstream secret body")

    async def empty(request: web.Request) -> web.Response:
        return web.Response(body=b"")

    app = web.Application(middlewares=[web.middleware(count)])
    app.router.add_get("/image/{name}", image)
    app.router.add_get("/redirect/{n}", redirect)
    app.router.add_get("/redirect-to", redirect_to)
    app.router.add_get("/slow", slow)
    app.router.add_get("/trickle", trickle)
    app.router.add_get("/big-sized", big_sized)
    app.router.add_get("/big-chunked", big_chunked)
    app.router.add_get("/echo-host", echo_host)
    app.router.add_get("/status/{code}", status)
    app.router.add_get("/empty", empty)
    return app


def _serve(app: web.Application, ready: threading.Event, box: dict, stop: threading.Event,
           ssl_context: ssl.SSLContext | None = None) -> None:
    async def main() -> None:
        runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_context)
        await site.start()
        box["port"] = runner.addresses[0][1]
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await runner.cleanup()

    asyncio.run(main())


def _run_server(server: MediaServer, images: dict[str, bytes],
                ssl_context: ssl.SSLContext | None = None) -> Iterator[MediaServer]:
    ready, stop, box = threading.Event(), threading.Event(), {}
    args = (_routes(server, images), ready, box, stop, ssl_context)
    thread = threading.Thread(target=_serve, args=args, daemon=True)
    thread.start()
    assert ready.wait(10), "media test server did not start within 10 s"
    server.port = box["port"]
    yield server
    stop.set()
    thread.join(10)


@pytest.fixture(scope="session")
def media_server(media_images: dict[str, bytes]) -> Iterator[MediaServer]:
    yield from _run_server(MediaServer(port=0), media_images)


@pytest.fixture(scope="session")
def media_tls_server(
    media_images: dict[str, bytes], media_tls_cert: tuple[str, str]
) -> Iterator[MediaServer]:
    """The same routes over HTTPS with the "localhost" certificate; `sni` records each TLS server name."""
    server = MediaServer(port=0)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(*media_tls_cert)
    context.sni_callback = lambda sock, name, ctx: server.sni.append(name)  # type: ignore[assignment]
    yield from _run_server(server, media_images, context)


@dataclass
class NetGuard:
    """What the code under test tried: connects (refused unless to 127.0.0.1) and DNS lookups."""

    connects: list[str] = field(default_factory=list)
    lookups: Counter[str] = field(default_factory=Counter)

    def outside(self) -> list[str]:
        return [host for host in self.connects if host != "127.0.0.1"]


@pytest.fixture
def media_net_guard(monkeypatch: pytest.MonkeyPatch) -> Iterator[NetGuard]:
    """Refuse (and record) any connect to an address other than 127.0.0.1 and any DNS lookup of a
    name other than localhost, so a policy bug fails the test instead of reaching the network."""
    guard = NetGuard()
    real_connect, real_getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def connect(sock: socket.socket, address: object) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            host = str(address[0])  # type: ignore[index]
            guard.connects.append(host)
            if host != "127.0.0.1":
                raise ConnectionRefusedError(f"test guard: connect to {host} refused")
        return real_connect(sock, address)  # type: ignore[arg-type]

    def getaddrinfo(host: object, *args: object, **kwargs: object) -> list:
        guard.lookups[str(host)] += 1
        if host not in ("localhost", "127.0.0.1"):
            raise socket.gaierror(socket.EAI_NONAME, f"test guard: lookup of {host!r} refused")
        return real_getaddrinfo(host, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield guard
    assert not guard.outside(), f"connected outside 127.0.0.1: {guard.outside()}"


@pytest.fixture(scope="session")
def media_tls_cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A self-signed certificate for the name "localhost" (not for 127.0.0.1), made with openssl."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not available")
    folder = tmp_path_factory.mktemp("media_tls")
    cert, key = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
         "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"],
        check=True, capture_output=True, timeout=60,
    )
    return cert, key
