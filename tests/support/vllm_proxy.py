"""The calls vLLM's E/P/D proxy makes, in its order and with its bodies, for tests that put it in front of epd.

Written from reading examples/online_serving/disaggregated_encoder/disagg_epd_proxy.py in vLLM's repository
(none of its code is here).  For one client chat request, with request id `rid` (the client's X-Request-Id, else
a fresh uuid):

1. encode, only if a message holds multimodal parts (`image_url`, `audio_url`, `input_audio`): one POST
   /v1/chat/completions per part, all at once, round robin over the encode URLs, each with X-Request-Id
   `<rid>:<index>:<6 hex>` and the body {"model": <the client's model>, "messages": [{"role": "user",
   "content": [<the part>]}], "max_tokens": 1, "stream": false}; the answers are only checked for 200
   (their ec_transfer_params are dropped: the prefill finds the embeddings by mm_hash);
2. prefill: POST /v1/chat/completions with X-Request-Id `rid` and a shallow copy of the client's body with
   `kv_transfer_params` {"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
   "remote_block_ids": null, "remote_host": null, "remote_port": null}, "stream": false, "max_tokens": 1,
   "max_completion_tokens": 1 only if the client sent that field, and no "stream_options"; no
   ec_transfer_params.  The answer's kv_transfer_params (when non-empty) go into the client's body;
3. decode: POST /v1/chat/completions with X-Request-Id `rid` and that body (the client's `stream` and
   `stream_options` as sent); its answer, JSON or the SSE bytes, is the client's answer.

Each call is recorded (`calls`: role, URL path, request id, body) so a test can check the order and bodies.
"""

from __future__ import annotations

import asyncio
import copy
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp

MM_TYPES = ("image_url", "audio_url", "input_audio")
CHAT = "/v1/chat/completions"
PREFILL_KV = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}


def mm_parts(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [part for message in body.get("messages", []) if isinstance(message.get("content"), list)
            for part in message["content"] if part.get("type") in MM_TYPES]


@dataclass
class VllmEpdProxy:
    encode_urls: list[str]
    prefill_url: str
    decode_url: str
    calls: list[tuple[str, str, str, dict[str, Any]]] = field(default_factory=list)

    async def _post(self, session: aiohttp.ClientSession, role: str, url: str, rid: str,
                    body: dict[str, Any]) -> aiohttp.ClientResponse:
        self.calls.append((role, CHAT, rid, copy.deepcopy(body)))
        return await session.post(url + CHAT, json=body, headers={"x-request-id": rid})

    async def _encode(self, session: aiohttp.ClientSession, client: dict[str, Any], rid: str) -> None:
        parts = mm_parts(client)
        replies = await asyncio.gather(*(
            self._post(session, "encode", self.encode_urls[i % len(self.encode_urls)],
                       f"{rid}:{i}:{uuid.uuid4().hex[:6]}",
                       {"model": client.get("model"), "messages": [{"role": "user", "content": [part]}],
                        "max_tokens": 1, "stream": False})
            for i, part in enumerate(parts)))
        for reply in replies:
            text = await reply.text()
            if reply.status != 200:
                raise RuntimeError(f"encode answered {reply.status}: {text[:300]}")

    async def _prefill(self, session: aiohttp.ClientSession, client: dict[str, Any], rid: str) -> dict[str, Any]:
        body = dict(client)
        body["kv_transfer_params"] = dict(PREFILL_KV)
        body["stream"] = False
        body["max_tokens"] = 1
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        body.pop("stream_options", None)
        reply = await self._post(session, "prefill", self.prefill_url, rid, body)
        answer = await reply.json(content_type=None)
        if reply.status != 200:
            raise RuntimeError(f"prefill answered {reply.status}: {answer}")
        kv = answer.get("kv_transfer_params") or {}
        return {**client, "kv_transfer_params": kv} if kv else client

    async def chat(self, client: dict[str, Any], request_id: str | None = None,
                   timeout_s: float = 120.0) -> tuple[int, Any]:
        """The client's answer: (status, JSON) or, streamed, (status, the SSE text)."""
        rid = request_id or str(uuid.uuid4())
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            await self._encode(session, client, rid)
            body = await self._prefill(session, client, rid)
            reply = await self._post(session, "decode", self.decode_url, rid, body)
            if body.get("stream"):
                return reply.status, (await reply.read()).decode()
            return reply.status, await reply.json(content_type=None)
