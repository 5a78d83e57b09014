"""A scripted OpenAI-compatible chat server with exact delays, for calibration and tests.

`epd bench --calibrate` runs it with no delays (a null server) to measure the
floor the client and loopback put under every figure; the tests run it with
known delays and check the figures against them. It is not a model server:
each answer is `max_tokens` chunks of "tok ".

Behaviour is chosen per URL: `/fake/<spec>/v1/...` with spec
`key=value,...` (the root `/v1/...` uses --spec), keys:
  ttft (s, default 0)  first content chunk this long after the request arrived
  itl (s, default 0)   then one chunk every `itl` seconds (absolute schedule)
  done (1)             send `data: [DONE]` at the end
  empty_first (0)      send a role chunk with empty content at once
  usage (1)            answer stream_options.include_usage with a usage chunk
  fail (none)          `CODE:K`: every K-th request gets HTTP CODE
  json (0)             ignore stream=true and answer one JSON body
  record (1)           keep the stats below (0: the leanest null server, for calibration)
  tag                  any text: a separate set of counters
GET /fake/<spec>/stats: requests, max in flight, images, distinct images,
distinct bodies. GET /fake/<spec>/metrics: epd's encoder-cache counters as
if an encoder cache held every image seen (first sight encoded, later ones
cache hits; every other hit counted as known to the coordinator).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

STATE_KEY: web.AppKey[dict[str, SpecState]] = web.AppKey("spec_state", dict)
DEFAULT_SPEC_KEY: web.AppKey[str] = web.AppKey("default_spec", str)


@dataclass
class SpecState:
    requests: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    images: int = 0
    seen_images: set[str] = field(default_factory=set)
    bodies: list[str] = field(default_factory=list)
    encoded: int = 0
    cache_hit: int = 0
    known_hits: int = 0

    def record_images(self, urls: list[str]) -> None:
        for url in urls:
            digest = hashlib.blake2b(url.encode(), digest_size=8).hexdigest()
            self.images += 1
            if digest not in self.seen_images:
                self.seen_images.add(digest)
                self.encoded += 1
            elif (self.cache_hit + self.known_hits) % 2:
                self.known_hits += 1
            else:
                self.cache_hit += 1


def parse_spec(spec: str) -> dict[str, str]:
    return dict(part.partition("=")[::2] for part in spec.split(",") if part)


def _chunk(content: str | None, role: bool = False, usage: dict[str, int] | None = None) -> bytes:
    choices = [] if content is None else [{"index": 0, "delta": ({"role": "assistant"} if role else {})
                                           | {"content": content}, "finish_reason": None}]
    body: dict[str, Any] = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "model": "fake-model",
                            "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return f"data: {json.dumps(body)}\n\n".encode()


def _prompt(body: dict[str, Any]) -> tuple[int, list[str]]:
    words, urls = 0, []
    for message in body.get("messages", []):
        content = message.get("content")
        parts: list[dict[str, Any]] = [{"type": "text", "text": content}] if isinstance(content, str) else content
        for part in parts or []:
            if part.get("type") == "text":
                words += len(part.get("text", "").split())
            elif part.get("type") == "image_url":
                urls.append(part["image_url"]["url"])
    return words + 64 * len(urls), urls


async def chat(request: web.Request) -> web.StreamResponse:
    arrived = time.perf_counter()
    spec_text = request.match_info.get("spec", request.app[DEFAULT_SPEC_KEY])
    spec, state = parse_spec(spec_text), request.app[STATE_KEY].setdefault(spec_text, SpecState())
    raw = await request.read()
    state.requests += 1
    state.in_flight += 1
    state.max_in_flight = max(state.max_in_flight, state.in_flight)
    try:
        return await _answer(request, spec, state, json.loads(raw), arrived)
    finally:
        state.in_flight -= 1


async def _answer(request: web.Request, spec: dict[str, str], state: SpecState, body: dict[str, Any],
                  arrived: float) -> web.StreamResponse:
    prompt_tokens, urls = _prompt(body)
    if spec.get("record", "1") == "1":
        state.bodies.append(hashlib.blake2b(json.dumps(body, sort_keys=True).encode(), digest_size=8).hexdigest())
        state.record_images(urls)
    if "fail" in spec:
        code, _, every = spec["fail"].partition(":")
        if state.requests % int(every or 1) == 0:
            return web.json_response({"error": {"message": f"scripted failure {code}"}}, status=int(code))
    tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
    ttft, itl = float(spec.get("ttft", 0)), float(spec.get("itl", 0))
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": tokens, "total_tokens": prompt_tokens + tokens}
    if spec.get("json") == "1":
        await _sleep_until(arrived + ttft + itl * (tokens - 1))
        message = {"role": "assistant", "content": "tok " * tokens}
        return web.json_response({"object": "chat.completion", "choices": [{"index": 0, "message": message}],
                                  "usage": usage})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    if spec.get("empty_first") == "1":
        await resp.write(_chunk("", role=True))
    for i in range(tokens):
        await _sleep_until(arrived + ttft + i * itl)
        await resp.write(_chunk("tok "))
    if spec.get("usage", "1") == "1" and (body.get("stream_options") or {}).get("include_usage"):
        await resp.write(_chunk(None, usage=usage))
    if spec.get("done", "1") == "1":
        await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _sleep_until(when: float) -> None:
    delay = when - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


async def models(_: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})


async def stats(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY].setdefault(request.match_info["spec"], SpecState())
    return web.json_response({"requests": state.requests, "max_in_flight": state.max_in_flight,
                              "images": state.images, "distinct_images": len(state.seen_images),
                              "bodies": state.bodies})


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY].setdefault(request.match_info["spec"], SpecState())
    lines = ["# TYPE epd_encode_items_total counter",
             f'epd_encode_items_total{{result="encoded"}} {float(state.encoded)}',
             f'epd_encode_items_total{{result="cache_hit"}} {float(state.cache_hit)}',
             f"epd_coordinator_encode_calls_total {float(state.encoded + state.cache_hit)}",
             f"epd_coordinator_ec_known_hits_total {float(state.known_hits)}",
             "# TYPE epd_coordinator_mm_items_total counter",
             f'epd_coordinator_mm_items_total{{source="known"}} {float(state.known_hits)}',
             f'epd_coordinator_mm_items_total{{source="cache_hit"}} {float(state.cache_hit)}',
             f'epd_coordinator_mm_items_total{{source="encoded"}} {float(state.encoded)}']
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


def build_app(default_spec: str = "") -> web.Application:
    app = web.Application(client_max_size=1 << 30)
    app[STATE_KEY] = {}
    app[DEFAULT_SPEC_KEY] = default_spec
    for prefix in ("", "/fake/{spec}"):
        app.router.add_post(prefix + "/v1/chat/completions", chat)
        app.router.add_get(prefix + "/v1/models", models)
    app.router.add_get("/fake/{spec}/stats", stats)
    app.router.add_get("/fake/{spec}/metrics", metrics)
    return app


async def serve(port: int, spec: str) -> None:
    runner = web.AppRunner(build_app(spec), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    bound = runner.addresses[0][1]
    print(f"listening on http://127.0.0.1:{bound}", flush=True)
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--spec", default="", help="behaviour of the root /v1 routes (see the module doc)")
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.port, args.spec))


if __name__ == "__main__":
    main()
