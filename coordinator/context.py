"""RequestContext: all per-request state of one pass through the pipeline, every field typed.

A step reads only the fields its row names under "used by" and sets only
those naming it under "set by"; the pipeline's recovery policy (pipeline.py)
clears what a missing entry made stale before it runs steps again.

| field            | set by                          | used by                                   |
|------------------|---------------------------------|-------------------------------------------|
| request_id       | http entry (request_ids.py)     | every step (ids, metadata, store keys), logs: unique |
| label            | http entry (header or body)     | answers (response id, X-Request-Id), aborts |
| principal        | http entry (the API key's name) | aborts (only the same key's requests)     |
| deadline         | http entry (deadlines.py)       | every call until the first token (gRPC timeouts) |
| total_deadline   | http entry (deadlines.py)       | the decode call (its gRPC deadline)       |
| idle_s           | http entry (deadlines.py)       | decode stream (longest gap between tokens) |
| kind             | http entry                      | render step, answers                      |
| body             | http entry (chat / completion)  | render step                               |
| stream           | http entry                      | http entry (SSE or JSON)                  |
| include_usage    | http entry                      | answers                                   |
| return_token_ids | http entry                      | answers                                   |
| generate         | http entry (generate)           | generate input step, answers              |
| rendered         | render / generate input step    | encode, prefill, decode steps, answers    |
| sampling         | render / generate input step    | prefill, decode steps, decode stream      |
| ec_handles       | generate input, encode step; cleared by recovery | prefill step          |
| inline_items     | encode step                     | prefill step                              |
| prefill          | prefill step; cleared by recovery | decode step, answers (prompt tokens)    |
| decode_stream    | decode step                     | pipeline.stream                           |
| resumed          | pipeline.stream (decode died mid-stream) | prefill, decode steps (tokens the client has) |
| recovered        | pipeline (recovery policy)      | pipeline (each recovery runs once)        |
| failovers        | failover loop (clients.py)      | logs, tests                               |
| failed_on        | failover loop (clients.py)      | failover loop: the retry budget           |
| max_retries      | http entry (--max-retries)      | failover loop                             |
| instances        | each step                       | logs, metrics                             |
| timings          | each step, pipeline             | metrics, logs, benchmarks                 |
| created, started | construction                    | answers, TTFT metric                      |
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal, Protocol

from services.protocol.answers import OutputDelta
from services.protocol.errors import DeadlineExceeded
from services.protocol.generate import GenerateRequest
from services.rpc.v1 import epd_pb2 as pb

Kind = Literal["chat", "completion", "generate"]


class OpenStream(Protocol):
    """An open decode call (decode_stream.DecodeStream): its answer deltas, and closing it."""

    def chunks(self) -> AsyncIterator[OutputDelta]: ...

    def close(self) -> None: ...


@dataclass
class RequestContext:
    request_id: str                       # internal: unique per request (request_ids.internal_id)
    deadline: float                       # time.monotonic(): first token (Pipeline.prepare) by then
    label: str = ""                       # the client's id (X-Request-Id / request_id), echoed, not unique
    principal: str = ""                   # who sent it (services.auth.principal): scopes aborts
    total_deadline: float = math.inf      # time.monotonic(): the whole answer by then
    idle_s: float = math.inf              # longest wait for the next token once streaming
    kind: Kind = "chat"
    body: bytes = b""
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    generate: GenerateRequest | None = None  # POST /inference/v1/generate only
    rendered: pb.RenderResponse | None = None
    sampling: pb.SamplingParams = field(default_factory=pb.SamplingParams)
    ec_handles: dict[str, bytes] = field(default_factory=dict)
    inline_items: set[str] = field(default_factory=set)   # mm_hashes prefill encodes itself
    prefill: pb.PrefillResponse | None = None
    decode_stream: OpenStream | None = None
    resumed: list[int] = field(default_factory=list)      # output token ids the client has, when resuming
    recovered: set[str] = field(default_factory=set)      # error codes the pipeline already recovered from
    failovers: int = 0
    failed_on: list[str] = field(default_factory=list)   # instances this request made fail (transport level)
    max_retries: int = 2                                  # transport-failure retries allowed, all stages together
    instances: dict[str, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.monotonic)  # for time to first token

    def time_left(self) -> float:
        """Seconds left before the first-token deadline; raises once it has passed."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(f"request {self.label or self.request_id} had no first token within its "
                                   "time-to-first-token bound (--ttft-timeout-s)", code="ttft_timeout")
        return left

    def total_left(self) -> float | None:
        """Seconds left of the whole request (None: unbounded)."""
        if self.total_deadline == math.inf:
            return None
        left = self.total_deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(f"request {self.label or self.request_id} exceeded its deadline")
        return left

    def image_items(self) -> list[pb.MultiModalItem]:
        return list(self.rendered.items) if self.rendered is not None else []

    def prompt_tokens(self) -> int:
        return self.prefill.prompt_tokens if self.prefill is not None else 0
