"""Timing of one streamed chat completion, event by event (vLLM's definitions).

- TTFT: send -> first chunk carrying non-empty content (or reasoning_content).
  Chunks without content (the role chunk some servers send before scheduling,
  usage-only chunks) do not count.
- ITL: the gaps between consecutive content chunks (per chunk, as vLLM).
- E2E latency: send -> last event ([DONE] when the server sends one, else the
  last data event before the connection closed).
- Output tokens: usage.completion_tokens when the server reports usage, else
  the number of content chunks.
The time spent in this module and the SSE decoder is the client's own
per-request overhead, added up in `client_s`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestResult:
    index: int
    start: float
    ok: bool = False
    ttft_s: float | None = None
    e2el_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    has_usage: bool = False
    num_chunks: int = 0
    client_s: float = 0.0
    status: int | None = None
    error: str | None = None
    image_ids: tuple[str, ...] = ()

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None for one-token answers."""
        if self.ttft_s is None or self.e2el_s is None or self.output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)


def _content(choice: dict[str, Any]) -> str:
    delta = choice.get("delta") or choice.get("message") or {}
    text = delta.get("content") or delta.get("reasoning_content") or choice.get("text") or ""
    return text if isinstance(text, str) else ""


class StreamRecorder:
    """Feeds on decoded SSE events (or a whole JSON answer) and fills a RequestResult."""

    def __init__(self, result: RequestResult, est_prompt_tokens: int) -> None:
        self.result = result
        self.est_prompt_tokens = est_prompt_tokens
        self.is_done = False
        self._last_event: float | None = None
        self._last_content: float | None = None

    def on_event(self, data: str, now: float) -> None:
        self._last_event = now
        if data.strip() == "[DONE]":
            self.is_done = True
            return
        try:
            self.on_object(json.loads(data), now)
        except (json.JSONDecodeError, AttributeError, TypeError) as exc:
            self.fail(f"unparsable stream event: {exc}")

    def on_object(self, obj: dict[str, Any], now: float) -> None:
        if "error" in obj:
            error = obj["error"]
            self.fail("stream error: " + str(error.get("message", error) if isinstance(error, dict) else error))
            return
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self._take_usage(usage)
        choices = obj.get("choices") or []
        if choices and _content(choices[0]):
            self._on_content(now)

    def _on_content(self, now: float) -> None:
        res = self.result
        if self._last_content is None:
            res.ttft_s = now - res.start
        else:
            res.itl_s.append(now - self._last_content)
        self._last_content = now
        res.num_chunks += 1

    def _take_usage(self, usage: dict[str, Any]) -> None:
        if isinstance(usage.get("completion_tokens"), int):
            self.result.output_tokens = usage["completion_tokens"]
            self.result.has_usage = True
        if isinstance(usage.get("prompt_tokens"), int):
            self.result.prompt_tokens = usage["prompt_tokens"]

    def fail(self, message: str, status: int | None = None) -> None:
        self.result.error = self.result.error or message[:300]
        self.result.status = status if status is not None else self.result.status
        self.is_done = True

    def finish(self) -> RequestResult:
        res = self.result
        if res.error is None and res.ttft_s is None:
            res.error = "no content received"
        res.ok = res.error is None
        if self._last_event is not None:
            res.e2el_s = self._last_event - res.start
        if not res.has_usage:
            res.output_tokens = res.num_chunks
        if not res.prompt_tokens:
            res.prompt_tokens = self.est_prompt_tokens
        return res
