"""The coordinator's OpenAI routes (coordinator/openai_api.py) over the real pipeline and scripted roles (real gRPC):
a chat answer and a stream built from decode's deltas, the request's label echoed, and a body error a 400."""

from __future__ import annotations

import asyncio

import httpx

from coordinator.openai_api import OpenAIApi
from coordinator.pipeline import Pipeline
from tests.support.scripted_roles import Bench


def _run(scenario):
    async def main():
        bench = Bench()
        cluster = await bench.start()
        try:
            return await scenario(OpenAIApi(cluster.config, cluster, Pipeline(cluster)))
        finally:
            await bench.stop()

    return asyncio.run(main())


async def _post(api: OpenAIApi, path: str, **kwargs) -> httpx.Response:
    """Through the routes as an ASGI app on this loop (the cluster's channels are bound to it)."""
    from starlette.applications import Starlette

    transport = httpx.ASGITransport(app=Starlette(routes=api.routes()))
    async with httpx.AsyncClient(transport=transport, base_url="http://coordinator", timeout=30) as client:
        return await client.post(path, **kwargs)


def test_a_chat_answer_carries_decodes_text_usage_and_the_label():
    async def scenario(api):
        return await _post(api, "/v1/chat/completions", json={"messages": []}, headers={"X-Request-Id": "lab-1"})

    reply = _run(scenario)
    body = reply.json()
    assert reply.status_code == 200 and reply.headers["x-request-id"] == "lab-1" and body["id"] == "chatcmpl-lab-1"
    assert body["choices"][0]["message"]["content"] == "abc" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 8, "completion_tokens": 3, "total_tokens": 11}


def test_a_completion_stream_sends_each_delta_then_done():
    async def scenario(api):
        return await _post(api, "/v1/completions", json={"prompt": "x", "stream": True})

    reply = _run(scenario)
    events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
    assert reply.status_code == 200 and events[-1] == "[DONE]"
    import json

    texts = [json.loads(e)["choices"][0]["text"] for e in events[:-1]]
    assert "".join(texts) == "abc" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"


def test_a_bad_stream_flag_is_a_400_before_any_stage_runs():
    async def scenario(api):
        reply = await _post(api, "/v1/chat/completions", json={"messages": [], "stream": "yes"})
        return reply, api.cluster

    reply, cluster = _run(scenario)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_type"
