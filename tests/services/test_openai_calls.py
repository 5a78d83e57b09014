"""The roles' render client for llm-d's OpenAI-format calls: no render configured, none reachable."""

from __future__ import annotations

import asyncio
import socket

import pytest

from services.config import EpdConfig
from services.openai_calls import RenderClient, render_client
from services.protocol.errors import Unavailable


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
    client = render_client(EpdConfig(openai_render_urls="http://a:1/,http://b:2", role_api_key="sk-role-1"))
    assert client.urls == ["http://a:1", "http://b:2"]
    assert client.headers == {"Authorization": "Bearer sk-role-1"}
    assert render_client(EpdConfig()).headers == {}
