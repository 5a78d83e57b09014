"""RequestContext: all per-request state of one pass through the pipeline.

| field            | set by            | used by                         |
|------------------|-------------------|---------------------------------|
| request_id       | app               | every step (gRPC request ids, logs) |
| deadline         | app               | every step (gRPC timeouts)      |
| body             | app               | render step                     |
| generate         | generate api      | generate input step, generate answer |
| rendered         | render step       | encode, prefill, decode steps   |
| ec_handles       | encode step       | prefill step                    |
| prefill          | prefill step      | decode step                     |
| instances        | each step         | logs, metrics                   |
| timings          | each step         | metrics, logs, benchmarks       |
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from services.protocol.errors import DeadlineExceeded
from services.protocol.generate import GenerateRequest
from services.rpc.v1 import epd_pb2 as pb


@dataclass
class RequestContext:
    request_id: str
    deadline: float                       # time.monotonic() value
    kind: str = "chat"                    # "chat" | "completion" | "generate"
    body: bytes = b""
    stream: bool = False
    include_usage: bool = False
    generate: GenerateRequest | None = None  # POST /inference/v1/generate only
    rendered: pb.RenderResponse | None = None
    ec_handles: dict[str, bytes] = field(default_factory=dict)
    prefill: pb.PrefillResponse | None = None
    instances: dict[str, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.monotonic)  # for time to first token
    extra: dict[str, Any] = field(default_factory=dict)

    def time_left(self) -> float:
        """Seconds left before the deadline; raises once it has passed."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(f"request {self.request_id} exceeded its deadline")
        return left

    def image_items(self) -> list[pb.MultiModalItem]:
        return list(self.rendered.items) if self.rendered is not None else []
