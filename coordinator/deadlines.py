"""The time bounds of one request: a first-token deadline, a stall bound between tokens, an optional total.

Serving answers take as long as they are long: one fixed total would cut a
healthy 3000-token answer.  So a request has three bounds instead
(services.config):

- time to first token, --ttft-timeout-s: render, encode, prefill and the
  first decode step (Pipeline.prepare) run under it; past it, 504;
- a stall bound, --stream-idle-timeout-s: once the answer has started, the
  next token must come within it (decode_stream.py), and the client must
  take what was sent within it (admission.py); past it, the answer is cut;
- a total deadline the client may set with `X-Request-Timeout: <seconds>`,
  capped by --max-request-timeout-s (the total when none is given): the
  decode call carries it as its gRPC deadline.

Who calls what: the route modules build a RequestContext from `Deadlines.for_request`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from services.config import EpdConfig
from services.protocol.errors import InvalidRequest

HEADER = "x-request-timeout"


@dataclass(frozen=True)
class Deadlines:
    first_token: float   # time.monotonic() values
    total: float
    idle_s: float

    @classmethod
    def for_request(cls, config: EpdConfig, header: str | None) -> Deadlines:
        now = time.monotonic()
        total = now + min(_client_total(header), config.limits.max_request_timeout_s)
        return cls(min(now + config.limits.ttft_timeout_s, total), total, config.limits.stream_idle_timeout_s)


def _client_total(header: str | None) -> float:
    if header is None:
        return math.inf
    try:
        seconds = float(header)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise InvalidRequest("X-Request-Timeout must be a positive number of seconds", code="invalid_timeout")
    return seconds
