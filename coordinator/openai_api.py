"""OpenAI response and stream-chunk shapes built from decode chunks."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from services.protocol.errors import EpdError, as_epd_error
from services.rpc.v1 import epd_pb2 as pb

from .context import RequestContext


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def response_id(ctx: RequestContext) -> str:
    return ("chatcmpl-" if ctx.kind == "chat" else "cmpl-") + ctx.request_id


def _choice(ctx: RequestContext, text: str, finish: str | None, delta: bool, role: bool = False) -> dict[str, Any]:
    if ctx.kind != "chat":
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    if not delta:
        message = {"role": "assistant", "content": text}
        return {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
    body = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
    return {"index": 0, "delta": body, "logprobs": None, "finish_reason": finish}


def _envelope(ctx: RequestContext, choices: list[dict[str, Any]], stream: bool) -> dict[str, Any]:
    assert ctx.rendered is not None
    kind = {"chat": "chat.completion", "completion": "text_completion"}[ctx.kind]
    obj = kind + ".chunk" if stream and ctx.kind == "chat" else kind
    return {"id": response_id(ctx), "object": obj, "created": ctx.created, "model": ctx.rendered.model,
            "choices": choices}


async def collect(ctx: RequestContext, chunks: AsyncIterator[pb.DecodeChunk]) -> dict[str, Any]:
    """Non-streaming answer: the whole text, finish reason and usage."""
    texts: list[str] = []
    token_ids: list[int] = []
    finish = "length"
    async for chunk in chunks:
        texts.append(chunk.text)
        token_ids.extend(chunk.token_ids)
        if chunk.finish_reason:
            finish = chunk.finish_reason
    assert ctx.prefill is not None and ctx.rendered is not None
    choice = _choice(ctx, "".join(texts), finish, delta=False)
    body = _envelope(ctx, [choice], stream=False)
    if ctx.extra.get("return_token_ids"):  # vLLM's extension: exact ids for clients that compare tokens
        choice["token_ids"] = token_ids
        body["prompt_token_ids"] = list(ctx.rendered.token_ids)
    body["usage"] = _usage(ctx.prefill.prompt_tokens, len(token_ids))
    return body


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()


async def stream_events(ctx: RequestContext, chunks: AsyncIterator[pb.DecodeChunk]) -> AsyncIterator[bytes]:
    """SSE: a role chunk, content deltas, a finish chunk, an optional usage chunk, [DONE].

    Errors after the stream started are sent in-stream as {"error": {...}}.
    """
    completion = 0
    try:
        if ctx.kind == "chat":
            yield sse(_with_usage(ctx, _envelope(ctx, [_choice(ctx, "", None, True, role=True)], True)))
        async for chunk in chunks:
            completion += len(chunk.token_ids)
            if chunk.text or chunk.finish_reason:
                choice = _choice(ctx, chunk.text, chunk.finish_reason or None, delta=True)
                yield sse(_with_usage(ctx, _envelope(ctx, [choice], True)))
        if ctx.include_usage:
            assert ctx.prefill is not None
            final = _envelope(ctx, [], True)
            final["usage"] = _usage(ctx.prefill.prompt_tokens, completion)
            yield sse(final)
    except Exception as exc:  # noqa: BLE001 - every failure becomes an in-stream error event
        yield sse(error_event(as_epd_error(exc)))
    yield sse("[DONE]")


def _with_usage(ctx: RequestContext, body: dict[str, Any]) -> dict[str, Any]:
    if ctx.include_usage:
        body["usage"] = None
    return body


def error_event(err: EpdError) -> dict[str, Any]:
    return err.to_body()
