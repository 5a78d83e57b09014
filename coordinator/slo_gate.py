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
    TPOT:  each stream decoding that has sent at least MIN_TOKENS tokens after its first is projected to its end:
           its time so far (first token to last delta) plus the tokens it still has to send (its max_tokens after
           the first, less those sent) at the pace of every stream decoding now (their time so far over their
           tokens since their first, all streams summed), over its max_tokens: the TPOT vLLM's benchmark will
           count for it; admit if their mean is within the target; else 429, Retry-After 1 s

`alone` is the running mean of the TTFT of requests that found nothing waiting (what one request costs the render,
encode, prefill path by itself); `interval` the running mean of the time between two first tokens while requests
were waiting (how fast the prompt side drains a queue, batching included). Until the first request has been measured
every request is admitted, and a request that finds nothing waiting always is (even one that alone takes longer than
the target: refusing it would serve nobody). The TPOT rule reads what the SLO counts, each stream's mean gap over
its whole life, not the latest gaps: a new prompt's prefill pauses every stream once for a few hundred ms, which a
stream's mean absorbs; while the streams are past the target on average, the next prompt (what would slow them
further) waits outside. A young stream's own mean is mostly those pauses (two of them in its first 8 tokens put a
30 ms pace past 100 ms), so what it has still to send is counted at the pace of all the streams (beside the rule
that read each stream's mean so far, at 4 req/s on SmolLM2: 12 requests refused instead of 19, goodput 1.02x,
benchmarks/results/open_loop_slo_projection.json). A stream whose max_tokens the gate was not told is projected no
further than its tokens so far. Both off (0) by default: a target is a deployment's choice, and a server without
one queues as vLLM does.
"""

from __future__ import annotations

import math
import time

from services.protocol.errors import Overloaded

_EMA = 0.2         # weight of the newest sample in the TTFT running means
MIN_TOKENS = 8     # tokens after its first before a stream counts (one pause weighs less than a token)


class SloGate:
    def __init__(self, slo_s: float = 0.0, tpot_slo_s: float = 0.0) -> None:
        self.slo_s, self.tpot_slo_s = slo_s, tpot_slo_s
        # id(record) -> [first token at, last delta at, tokens since, tokens it may send after its first (0: unknown)]
        self._streams: dict[int, list[float]] = {}
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

    def first_token(self, key: int, expected: int | None = None) -> None:
        """A request's first token went out: the running means learn from it.  `expected`: the tokens it may send
        after this one (its max_tokens less one), when known."""
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
        self._streams[key] = [now, now, 0.0, float(expected or 0)]

    @property
    def tpot_s(self) -> float | None:
        """The mean projected TPOT of the streams decoding with at least MIN_TOKENS tokens after their first: each
        one's time so far, plus its tokens still to send at the pace of all the streams, over its max_tokens."""
        counted = [stream for stream in self._streams.values() if stream[2] >= MIN_TOKENS]
        if not counted:
            return None
        tokens = sum(stream[2] for stream in self._streams.values())
        pace = sum(last - first for first, last, _, _ in self._streams.values()) / tokens
        spans = [((last - first) + max(0.0, expected - count) * pace) / max(expected, count)
                 for first, last, count, expected in counted]
        return sum(spans) / len(spans)

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
