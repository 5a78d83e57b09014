"""aiohttp client for an OpenAI-compatible chat endpoint (streaming).

aiohttp, not httpx: here it reaches ~4,000 requests/s against a trivial
server where httpx (the openai SDK's transport) stops near 500, which would
make the client the bottleneck of the figures it reports.

URLs: an endpoint may be given as `http://host:port`, `.../v1` or the full
`.../v1/chat/completions`; `chat_url`/`models_url` normalize them.
"""

from __future__ import annotations

import time
from typing import Any

import aiohttp

from .config import BenchError
from .sse import SseDecoder
from .stream import RequestResult, StreamRecorder
from .workloads import BenchRequest

_CHAT_SUFFIX = "/chat/completions"


def api_base(url: str) -> str:
    url = url.rstrip("/")
    if url.endswith(_CHAT_SUFFIX):
        return url[: -len(_CHAT_SUFFIX)]
    return url if url.endswith("/v1") else url + "/v1"


def chat_url(url: str) -> str:
    return api_base(url) + _CHAT_SUFFIX


def models_url(url: str) -> str:
    return api_base(url) + "/models"


def new_session(timeout_s: float, api_key: str | None = None, force_close: bool = False) -> aiohttp.ClientSession:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # limit=0: the load generator decides concurrency, not the connection pool.  force_close: one
    # connection per request (llama-server closes reused connections after a few requests).
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, force_close=force_close)
    return aiohttp.ClientSession(connector=connector, headers=headers,
                                 timeout=aiohttp.ClientTimeout(total=timeout_s))


async def first_model(session: aiohttp.ClientSession, url: str) -> str:
    """The first model id the server lists at /v1/models."""
    try:
        async with session.get(models_url(url)) as resp:
            body = await resp.json(content_type=None)
        return str(body["data"][0]["id"])
    except (TimeoutError, aiohttp.ClientError, KeyError, IndexError, TypeError, ValueError) as exc:
        raise BenchError(f"cannot read the model name from {models_url(url)} ({exc!r}); pass --model") from exc


class ChatClient:
    """Sends BenchRequests to one endpoint and times their streams."""

    def __init__(self, session: aiohttp.ClientSession, url: str, model: str,
                 extra_body: dict[str, Any] | None = None) -> None:
        self.session = session
        self.url = chat_url(url)
        self.model = model
        self.extra_body = extra_body or {}

    async def send(self, request: BenchRequest) -> RequestResult:
        payload = request.payload(self.model, self.extra_body)
        result = RequestResult(request.index, time.perf_counter(), image_ids=request.image_ids)
        recorder = StreamRecorder(result, request.est_prompt_tokens)
        try:
            async with self.session.post(self.url, data=payload,
                                         headers={"Content-Type": "application/json"}) as resp:
                result.status = resp.status
                await self._read(resp, recorder)
        except TimeoutError:
            recorder.fail("timeout")
        except aiohttp.ClientError as exc:
            recorder.fail(f"{type(exc).__name__}: {exc}")
        return recorder.finish()

    async def _read(self, resp: aiohttp.ClientResponse, recorder: StreamRecorder) -> None:
        if resp.status != 200:
            text = (await resp.text(errors="replace"))[:200]
            recorder.fail(f"HTTP {resp.status}: {text}", resp.status)
            return
        if resp.content_type == "application/json":  # the server ignored stream=true
            await self._read_json(resp, recorder)
            return
        await self._read_sse(resp, recorder)

    async def _read_sse(self, resp: aiohttp.ClientResponse, recorder: StreamRecorder) -> None:
        decoder = SseDecoder()
        result = recorder.result
        async for chunk in resp.content.iter_any():
            now = time.perf_counter()
            for data in decoder.feed(chunk):
                recorder.on_event(data, now)
            result.client_s += time.perf_counter() - now
            if recorder.is_done:
                return
        now = time.perf_counter()
        for data in decoder.close():
            recorder.on_event(data, now)
        result.client_s += time.perf_counter() - now

    async def _read_json(self, resp: aiohttp.ClientResponse, recorder: StreamRecorder) -> None:
        body: Any = await resp.json(content_type=None)
        now = time.perf_counter()
        recorder.on_object(body if isinstance(body, dict) else {}, now)
        recorder.on_event("[DONE]", now)
        recorder.result.client_s += time.perf_counter() - now
