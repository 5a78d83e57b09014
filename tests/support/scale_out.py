"""An llm-d-style orchestrator for tests: drives render, encode, prefill and decode over plain HTTP.

Only the PROTOCOL.md JSON bodies cross the wire; the helpers do what a real
orchestrator does to a render answer: send it (kwargs_data) to encode, strip
kwargs_data and add the returned ec_transfer_params for prefill, then hand the
kv_transfer_params to decode and derender the tokens.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.support.cluster import RunningCluster, metric_value

ROLES = ("render", "encode", "prefill", "decode")


def metadata_only(generate: dict[str, Any]) -> dict[str, Any]:
    """The render answer as prefill gets it: mm_metadata, no kwargs_data."""
    body = copy.deepcopy(generate)
    if body.get("features"):
        body["features"]["kwargs_data"] = None
    return body


def sse_events(reply: httpx.Response) -> list[Any]:
    """The `data:` payloads of an SSE answer; "[DONE]" stays a string."""
    events = []
    for line in reply.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


@dataclass
class Trace:
    """Every answer of one orchestrated request."""

    generate: dict[str, Any]
    encode: dict[str, Any] | None = None
    prefill: dict[str, Any] = field(default_factory=dict)
    decode: dict[str, Any] = field(default_factory=dict)
    chat: dict[str, Any] = field(default_factory=dict)


class Orchestrator:
    def __init__(self, cluster: RunningCluster, timeout: float = 60.0) -> None:
        self.cluster = cluster
        self.urls = {role: cluster.http_urls(role)[0] for role in ROLES}
        self.http = httpx.Client(timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def post(self, role: str, path: str, body: Any, **kwargs: Any) -> httpx.Response:
        base = self.cluster.url if role == "coordinator" else self.urls[role]
        return self.http.post(base + path, json=body, **kwargs)

    def ok(self, role: str, path: str, body: Any, **kwargs: Any) -> Any:
        reply = self.post(role, path, body, **kwargs)
        assert reply.status_code == 200, f"{role} {path}: {reply.status_code} {reply.text[:500]}"
        return reply.json()

    def metric(self, role: str, name: str) -> float:
        base = self.cluster.url if role == "coordinator" else self.urls[role]
        return metric_value(self.http.get(base + "/metrics").text, name)

    def render(self, chat: dict[str, Any]) -> dict[str, Any]:
        return self.ok("render", "/v1/chat/completions/render", chat)

    def encode(self, generate: dict[str, Any]) -> dict[str, Any]:
        return self.ok("encode", "/inference/v1/generate", generate)

    def prefill_body(self, generate: dict[str, Any], ec: dict[str, Any] | None) -> dict[str, Any]:
        body = metadata_only(generate)
        body["ec_transfer_params"] = ec
        body["sampling_params"] = {**generate["sampling_params"], "max_tokens": 1}
        body["kv_transfer_params"] = {"do_remote_decode": True}
        body["stream"] = False
        return body

    def decode_body(self, generate: dict[str, Any], kv: dict[str, Any], **extra: Any) -> dict[str, Any]:
        return {"request_id": generate["request_id"], "token_ids": generate["token_ids"],
                "sampling_params": generate["sampling_params"], "kv_transfer_params": kv, **extra}

    def run(self, chat: dict[str, Any]) -> Trace:
        """render -> encode (if there are images) -> prefill -> decode -> derender."""
        trace = Trace(self.render(chat))
        ec = None
        if trace.generate.get("features"):
            trace.encode = self.encode(trace.generate)
            ec = trace.encode["ec_transfer_params"]
        trace.prefill = self.ok("prefill", "/inference/v1/generate", self.prefill_body(trace.generate, ec))
        kv = trace.prefill["kv_transfer_params"]
        trace.decode = self.ok("decode", "/inference/v1/generate", self.decode_body(trace.generate, kv))
        trace.chat = self.ok("render", "/v1/chat/completions/derender", {
            "generate_response": trace.decode, "prompt_tokens": trace.generate["token_ids"], "chat_request": chat})
        return trace
