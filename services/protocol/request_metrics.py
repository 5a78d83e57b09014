"""vLLM's per-request `metrics` on chat and completion answers (`--enable-per-request-metrics`).

vLLM 0.32 (`build_per_request_timing_metrics`) puts `PerRequestMetrics` on the
answer when its server runs with --enable-per-request-metrics: on a whole
answer at the top level, on a streamed one only on the final usage chunk
(so only with `stream_options.include_usage`).  The same five fields here, from
the coordinator's clock (monotonic):

- `queue_time_ms`: arrival -> the pipeline's start (body read and parsed,
  admitted).  epd has no scheduler queue in front of the pipeline (admission
  answers 429 instead of queueing); a wait for a decode row or KV room happens
  later and counts in the time to first token.
- `time_to_first_token_ms`: the pipeline's start -> the first output token
  (render, encode, prefill, the KV hand-off), as vLLM's scheduled -> first token.
- `generation_time_ms`: first -> last output token; `mean_itl_ms` that over
  tokens - 1 (None for one token); `tokens_per_second`: tokens over
  start -> last token.

A field whose instants are missing (no token came) is None, as in vLLM.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


@dataclass
class RequestTiming:
    arrived: float                 # time.monotonic() when the request came in
    started: float                 # when the pipeline started on it
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0

    def saw(self, count: int, now: float | None = None) -> None:
        """`count` output tokens arrived now."""
        if count <= 0:
            return
        now = time.monotonic() if now is None else now
        if self.first_token is None:
            self.first_token = now
        self.last_token, self.tokens = now, self.tokens + count

    def metrics(self) -> dict[str, Any]:
        """vLLM's PerRequestMetrics as JSON."""
        ms = 1000.0
        first, last = self.first_token, self.last_token
        generation = (last - first) * ms if first is not None and last is not None else None
        inference = (last - self.started) * ms if last is not None else None
        return {
            "time_to_first_token_ms": (first - self.started) * ms if first is not None else None,
            "generation_time_ms": generation,
            "queue_time_ms": (self.started - self.arrived) * ms,
            "mean_itl_ms": generation / (self.tokens - 1) if generation is not None and self.tokens > 1 else None,
            "tokens_per_second": self.tokens / inference * ms if inference else None,
        }
