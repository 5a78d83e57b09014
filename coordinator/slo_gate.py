"""Admission by the SLO targets (`--ttft-slo-ms`, `--tpot-slo-ms`): past capacity, refuse at once what would miss
them anyway.

Past its capacity a server that admits everything serves everyone late: the queue in front of the prompt side
grows, every request's time to first token passes the target, the streams already decoding slow down as new
prompts take the cores, and goodput (requests that met their SLO per second) falls towards zero while the server
stays busy.  vLLM queues without bound; this gate instead keeps the load as high as the targets allow and answers
the rest 429 with Retry-After before any work, so a client (or the router in front) can retry later or elsewhere.

The rules, in the coordinator (no role is asked):

    TTFT:  waiting   = requests admitted that have no first token yet
           predicted = alone + waiting * interval
           admit if waiting == 0 or predicted <= the target; else 429, Retry-After = ceil(predicted - target) s
    TPOT:  each stream decoding that has sent at least MIN_TOKENS tokens after its first has a TPOT so far
           (time from its first token to its last delta / tokens since): what vLLM's benchmark would count for
           it if it ended now; admit if their mean is within the target; else 429, Retry-After 1 s

`alone` is the running mean of the TTFT of requests that found nothing waiting (what one request costs the render,
encode, prefill path by itself); `interval` the running mean of the time between two first tokens while requests
were waiting (how fast the prompt side drains a queue, batching included). Until the first request has been measured
every request is admitted, and a request that finds nothing waiting always is (even one that alone takes longer than
the target: refusing it would serve nobody). The TPOT rule reads what the SLO counts, each stream's mean gap over
its life so far, not the latest gaps: a new prompt's prefill pauses every stream once for a few hundred ms, which a
stream's mean absorbs; while the streams are past the target on average, the next prompt (what would slow them
further) waits outside. Both off (0) by default: a target is a deployment's choice, and a server without one queues
as vLLM does.
"""

from __future__ import annotations

import math
import time

from services.protocol.errors import Overloaded

_EMA = 0.2         # weight of the newest sample in the TTFT running means
MIN_TOKENS = 8     # tokens after its first before a stream's TPOT so far counts (one pause weighs less than a token)


class SloGate:
    def __init__(self, slo_s: float = 0.0, tpot_slo_s: float = 0.0) -> None:
        self.slo_s, self.tpot_slo_s = slo_s, tpot_slo_s
        self._streams: dict[int, list[float]] = {}   # id(record) -> [first token at, last delta at, tokens since]
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
        tpot = self.tpot_s if self.tpot_slo_s else None
        if tpot is not None and tpot > self.tpot_slo_s:
            return Overloaded(f"the {len(self._streams)} streams decoding get a token every "
                              f"{tpot * 1000:.0f} ms, past the {self.tpot_slo_s * 1000:g} ms target "
                              "(--tpot-slo-ms); retry later", code="tpot_slo", retry_after_s=1.0)
        predicted = self.predicted_s()
        if not self.slo_s or self.waiting == 0 or predicted is None or predicted <= self.slo_s:
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
        self._streams[key] = [now, now, 0.0]

    @property
    def tpot_s(self) -> float | None:
        """The mean TPOT so far of the streams decoding with at least MIN_TOKENS tokens after their first."""
        spans = [(last - first) / count for first, last, count in self._streams.values() if count >= MIN_TOKENS]
        return sum(spans) / len(spans) if spans else None

    def tokens(self, key: int, count: int) -> None:
        """A delta of `count` tokens of a decoding stream went out."""
        stream = self._streams.get(key)
        if stream is not None and count >= 1:
            stream[1] = time.monotonic()
            stream[2] += count

    def ended(self, key: int) -> None:
        """The request ended (answered, failed or cancelled); one without a first token no longer waits."""
        self._streams.pop(key, None)
        if self._arrivals.pop(key, None) is not None:
            self.waiting -= 1
            if not self.waiting:
                self._last_first = None


def _mean(old: float | None, sample: float) -> float:
    return sample if old is None else (1 - _EMA) * old + _EMA * sample
