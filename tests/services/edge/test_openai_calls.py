"""The roles' render client for llm-d's OpenAI-format calls: no render configured, none reachable."""

from __future__ import annotations

import asyncio
import socket

import pytest

from services.config import EpdConfig
from services.edge.openai_calls import RenderClient, render_client
from services.protocol.errors import EpdError, Unavailable


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_role_without_render_urls_answers_503_naming_the_flag():
    with pytest.raises(Unavailable) as err:
        asyncio.run(RenderClient([""]).render(b"{}", None))
    assert err.value.status == 503 and err.value.code == "render_not_configured"
    assert "--openai-render-urls" in err.value.message


def test_every_render_down_is_503_render_unavailable_naming_each():
    urls = [f"http://127.0.0.1:{_closed_port()}", f"http://127.0.0.1:{_closed_port()}"]
    with pytest.raises(Unavailable) as err:
        asyncio.run(RenderClient(urls, timeout_s=5).render(b"{}", "r1"))
    assert err.value.code == "render_unavailable"
    assert err.value.message.startswith("no render instance answered (")
    assert all(f"{u}: ClientConnectorError" in err.value.message for u in urls)


def test_render_client_from_config_uses_the_urls_and_the_role_key():
    client = render_client(EpdConfig.of(openai_render_urls="http://a:1/,http://b:2", role_api_key="sk-role-1"))
    assert client.urls == ["http://a:1", "http://b:2"]
    assert client.headers == {"Authorization": "Bearer sk-role-1"}
    assert render_client(EpdConfig()).headers == {}


def test_render_call_sends_the_body_the_id_the_key_and_mm_payload_none_when_asked():
    """Against a real HTTP server standing in for render: what the role sends, and errors passed on."""
    from aiohttp import web

    seen: list[tuple[bytes, dict]] = []

    async def render(request: web.Request) -> web.Response:
        seen.append((await request.read(), {k.lower(): v for k, v in request.headers.items()}))
        if len(seen) == 3:
            return web.json_response({"error": {"message": "bad image", "type": "invalid_request_error",
                                                "code": "invalid_image"}}, status=400)
        return web.json_response({"request_id": "chatcmpl-r1", "token_ids": [1, 2, 3]})

    async def run() -> list:
        app = web.Application()
        app.router.add_post("/v1/chat/completions/render", render)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", _closed_port())
        await site.start()
        url = f"http://127.0.0.1:{site._port}"  # noqa: SLF001 - the port the site bound
        client = RenderClient([f"http://127.0.0.1:{_closed_port()}", url], api_key="sk-role-2")
        try:
            first = await client.render(b'{"messages": []} \n', "r1")
            second = await client.render(b'{"messages": []}', None, "none")
            with pytest.raises(EpdError) as err:
                await client.render(b'{"messages": []}', None)
            return [first, second, err.value]
        finally:
            await runner.cleanup()

    first, second, error = asyncio.run(run())
    assert first.token_ids == [1, 2, 3] and second.request_id == "chatcmpl-r1"
    assert seen[0][0] == b'{"messages": []} \n'
    assert seen[0][1]["x-request-id"] == "r1" and seen[0][1]["authorization"] == "Bearer sk-role-2"
    assert seen[1][0] == b'{"messages": [], "mm_payload": "none"}' and "x-request-id" not in seen[1][1]
    assert (error.status, error.code, error.message) == (400, "invalid_image", "bad image")
