"""Admission by the TTFT target (`--ttft-slo-ms`): past capacity, refuse at once what would miss it anyway.

Past its capacity a server that admits everything serves everyone late: the queue in front of the prompt side
grows, every request's time to first token passes the target, and goodput (requests that met their SLO per
second) falls towards zero while the server stays busy.  vLLM queues without bound; this gate instead keeps
the queue as long as the target allows and answers the rest 429 with Retry-After before any work, so a
client (or the router in front) can retry later or elsewhere.

The rule, in the coordinator (no role is asked):

    waiting   = requests admitted that have no first token yet
    predicted = alone + waiting * interval
    admit if waiting == 0 or predicted <= the target; else 429, Retry-After = ceil(predicted - target) s

`alone` is the running mean of the TTFT of requests that found nothing waiting (what one request costs the
render, encode, prefill path by itself); `interval` the running mean of the time between two first tokens while
requests were waiting (how fast the prompt side drains a queue, batching included).  Until the first request
has been measured every request is admitted, and a request that finds nothing waiting always is (even one
that alone takes longer than the target: refusing it would serve nobody).  Off (0) by default: a target is a
deployment's choice, and a server without one queues as vLLM does.
"""

from __future__ import annotations

import math
import time

from services.protocol.errors import Overloaded

_EMA = 0.2   # weight of the newest sample in both running means


class TtftGate:
    def __init__(self, slo_s: float) -> None:
        self.slo_s = slo_s
        self.waiting = 0
        self.alone_s: float | None = None
        self.interval_s: float | None = None
        self._last_first: float | None = None   # when the last first token came while others still waited
        self._arrivals: dict[int, tuple[float, int]] = {}   # id(record) -> (admitted at, waiting then)

    def predicted_s(self) -> float | None:
        if self.alone_s is None:
            return None
        return self.alone_s + self.waiting * (self.interval_s if self.interval_s is not None else self.alone_s)

    def refusal(self) -> Overloaded | None:
        """Why a request arriving now is refused, or None to admit it."""
        predicted = self.predicted_s()
        if self.waiting == 0 or predicted is None or predicted <= self.slo_s:
            return None
        wait_s = max(1, math.ceil(predicted - self.slo_s))
        return Overloaded(f"{self.waiting} requests wait for their first token; a new one would get it in about "
                          f"{predicted:.1f} s, past the {self.slo_s * 1000:g} ms target (--ttft-slo-ms); retry "
                          "later", code="ttft_slo", retry_after_s=float(wait_s))

    def admitted(self, key: int) -> None:
        self._arrivals[key] = (time.monotonic(), self.waiting)
        self.waiting += 1

    def first_token(self, key: int) -> None:
        """A request's first token went out: the running means learn from it."""
        arrival = self._arrivals.pop(key, None)
        if arrival is None:
            return
        now = time.monotonic()
        self.waiting -= 1
        at, ahead = arrival
        if ahead == 0:
            self.alone_s = _mean(self.alone_s, now - at)
        if self._last_first is not None:
            self.interval_s = _mean(self.interval_s, now - self._last_first)
        self._last_first = now if self.waiting else None   # the next interval counts only while a queue drains

    def ended(self, key: int) -> None:
        """The request ended (answered, failed or cancelled); one without a first token no longer waits."""
        if self._arrivals.pop(key, None) is not None:
            self.waiting -= 1
            if not self.waiting:
                self._last_first = None


def _mean(old: float | None, sample: float) -> float:
    return sample if old is None else (1 - _EMA) * old + _EMA * sample
