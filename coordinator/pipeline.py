"""The ordered pipeline: generate input -> render -> encode -> prefill -> decode (opened), then the stream.

One straight line, the same at every load and over every transport: `prepare` runs the steps in order over
one RequestContext; each step reads and writes only its rows of the context table (context.py) and never
calls another step.  What happens when a stage finds an entry gone is one policy, here (RECOVERIES): the
error code names the step to run again from and what to forget first, and each code is recovered from once
per request; failover between instances of one role is the one loop in clients.py, inside a step.

A decode instance that fails after the answer started is one more recovery (`stream`): the prompt and the
tokens the client has are prefilled again and decode goes on from the last of them on another instance
(ctx.resumed), so the client's answer goes on with no gap, no repeated token and no error; greedy and
seeded answers are the same as an undisturbed run's (decode judges the resumed tokens again and seeded draws
depend only on (seed, index): services/sampling/sampler.py).  Each resume costs the request one retry of its
transport budget (--max-retries), like any failover.

A shared store that is briefly away (Redis restarting: every instance's calls fail with `*_store_unavailable`, and
the roles turn not ready) is waited out, not answered: the request pauses STORE_PAUSE_S and runs again from the step
the store's recovery names (the entries may be gone: encode or prefill again), for up to STORE_OUTAGE_S, also
while no instance of a role is ready meanwhile (`<role>_unavailable`).  Only requests that met the outage wait; one
that arrives while no instance is ready is answered 503 at once (the coordinator's /ready is false then).

Adding a step is one file in steps/ and one line in STEPS.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

from services.observability import activity
from services.protocol.answers import OutputDelta
from services.protocol.errors import EpdError, InternalError

from . import inflight
from .cluster import Cluster
from .context import RequestContext
from .decode_stream import DecodeFailed
from .samples import num_samples, resume_each
from .steps.base import Step
from .steps.decode import DecodeStep
from .steps.encode import EncodeStep
from .steps.generate_input import GenerateInputStep
from .steps.prefill import PrefillStep
from .steps.render import RenderStep
from .versions import check_answer

log = logging.getLogger(__name__)
S = TypeVar("S", bound=Step)
STEPS: list[type[Step]] = [GenerateInputStep, RenderStep, EncodeStep, PrefillStep, DecodeStep]
EC_MISSING_CODE = "ec_entry_missing"
KV_MISSING_CODE = "kv_entry_missing"
MM_MISSING_CODE = "mm_entry_missing"
STORE_PAUSE_S = 0.25     # between two tries of a request waiting for its store
STORE_OUTAGE_S = 10.0    # the longest a request waits for a store that is away (a Redis restart takes ~1 s)


@dataclass(frozen=True)
class Recovery:
    """A stage reported `code`: forget what it made stale, then run the steps again from `rerun_from`."""

    rerun_from: str
    forget: Callable[[Pipeline, RequestContext], None]


def _forget_rendered(_: Pipeline, ctx: RequestContext) -> None:
    ctx.rendered = None
    ctx.inline_items.clear()


RECOVERIES: dict[str, Recovery] = {
    # encode found the processed image gone from the mm store (evicted, expired, render died): render again
    MM_MISSING_CODE: Recovery("generate_input", _forget_rendered),
    # prefill found an embedding gone (evicted, expired, its encoder died): encode again
    EC_MISSING_CODE: Recovery("encode", lambda p, ctx: p.step(EncodeStep).forget_handles(ctx)),
    # decode found the KV entry gone (evicted, expired, consumed by an instance that died): prefill again
    KV_MISSING_CODE: Recovery("prefill", lambda p, ctx: PrefillStep.forget_answer(ctx)),
}
# A store that does not answer (Redis restarting): what it held may be gone when it is back, so the same steps again.
STORE_OUTAGES: dict[str, str] = {"mm_store_unavailable": MM_MISSING_CODE, "ec_store_unavailable": EC_MISSING_CODE,
                                 "kv_store_unavailable": KV_MISSING_CODE}


def expected_after_first(ctx: RequestContext) -> int | None:
    """The tokens a request's answer may send after its first (its max_tokens less one), when it set max_tokens."""
    sampling = ctx.sampling
    return sampling.max_tokens - 1 if sampling.HasField("max_tokens") and sampling.max_tokens > 0 else None


class Pipeline:
    def __init__(self, cluster: Cluster, steps: list[type[Step]] | None = None) -> None:
        self.cluster = cluster
        self.steps: list[Step] = [cls(cluster) for cls in steps or STEPS]

    def step(self, cls: type[S]) -> S:
        return next(s for s in self.steps if isinstance(s, cls))

    def _index(self, name: str) -> int:
        return next(i for i, s in enumerate(self.steps) if s.name == name)

    async def prepare(self, ctx: RequestContext) -> None:
        """Run every step up to the decode stream's first chunk; each records its own timing."""
        inflight.bind(ctx.request_id, ctx.label, ctx.principal)  # POST /abort_requests can cancel it from now on
        weights = getattr(self.cluster, "weights", None)
        if weights is not None:
            await weights.enter(ctx)   # one weight version for every stage (coordinator/weights.py)
        await self._run(ctx, 0)

    async def _run(self, ctx: RequestContext, index: int) -> None:
        outage_since: float | None = None   # when this request first met a store that did not answer
        while index < len(self.steps):
            step = self.steps[index]
            activity.mark(f"coordinator.{step.name}.start")
            try:
                await step.execute(ctx)
            except EpdError as exc:
                if exc.code in STORE_OUTAGES and outage_since is None:
                    outage_since = time.monotonic()
                if outage_since is not None and self._waits_out(ctx, exc, outage_since):
                    await asyncio.sleep(STORE_PAUSE_S)
                    index = self._after_outage(step, ctx, exc)
                    continue
                index = self._recover(step, ctx, exc)
                continue
            activity.mark(f"coordinator.{step.name}.end")
            if step.name in ctx.timings:
                self.cluster.metrics.stage_seconds.labels(step.name).observe(ctx.timings[step.name])
            index += 1

    @staticmethod
    def _waits_out(ctx: RequestContext, exc: EpdError, since: float) -> bool:
        """Whether to pause and try again: the store (or, meanwhile, every instance of a role) is away, and the
        outage and the request's first-token bound leave room."""
        away = exc.code in STORE_OUTAGES or exc.code.endswith("_unavailable")
        now = time.monotonic()
        return away and now - since < STORE_OUTAGE_S and ctx.deadline - now > STORE_PAUSE_S

    def _after_outage(self, step: Step, ctx: RequestContext, exc: EpdError) -> int:
        """The step to run again: the store's recovery (what it held may be lost), or the step that found no ready
        instance."""
        missing = STORE_OUTAGES.get(exc.code)
        if missing is None:
            return self._index(step.name)
        self.cluster.metrics.retries.labels(step.name, exc.code).inc()
        RECOVERIES[missing].forget(self, ctx)
        return self._index(RECOVERIES[missing].rerun_from)

    def _recover(self, step: Step, ctx: RequestContext, exc: EpdError) -> int:
        """The index to run from after `exc`, or `exc` raised again when it is not (or no longer) recoverable."""
        recovery = RECOVERIES.get(exc.code)
        if recovery is None or exc.code in ctx.recovered:
            raise exc
        ctx.recovered.add(exc.code)
        self.cluster.metrics.retries.labels(step.name, exc.code).inc()
        recovery.forget(self, ctx)
        return self._index(recovery.rerun_from)

    async def stream(self, ctx: RequestContext) -> AsyncIterator[OutputDelta]:
        """The decode stream `prepare` opened, as answer deltas, resumed on another decode instance if the one
        serving it fails; records TTFT and the decode time."""
        if ctx.decode_stream is None:
            raise InternalError("the pipeline was not prepared", code="internal_error")
        started, first = time.perf_counter(), True
        sent: dict[int, list[int]] = {}   # per sample: the token ids the client has
        done: set[int] = set()            # samples whose last delta went out
        try:
            while True:
                try:
                    async for delta in ctx.decode_stream.chunks():
                        if first:
                            activity.mark("coordinator.first_delta")
                            self.cluster.metrics.ttft_seconds.observe(time.monotonic() - ctx.started)
                            inflight.first_token(expected_after_first(ctx))   # admission's SLO gate learns from it
                            first = False
                        elif delta.index == 0:   # one sample's gaps (n > 1 samples' deltas interleave)
                            inflight.tokens(len(delta.token_ids))   # and from the gaps between tokens
                        check_answer(ctx, "decode", delta.weight_version or "", self.cluster.metrics)
                        sent.setdefault(delta.index, []).extend(delta.token_ids)
                        if delta.finish_reason:
                            done.add(delta.index)
                        yield delta
                    return
                except DecodeFailed as exc:
                    await self._resume(ctx, sent, done, exc)
        finally:
            if ctx.decode_stream is not None:
                ctx.decode_stream.close()
            ctx.timings["decode"] = ctx.timings.get("decode_first_chunk", 0.0) + time.perf_counter() - started
            self.cluster.metrics.stage_seconds.labels("decode").observe(ctx.timings["decode"])

    async def _resume(self, ctx: RequestContext, sent: dict[int, list[int]], done: set[int],
                      failure: DecodeFailed) -> None:
        """Prefill the prompt and `sent` but its last token again, then open decode from that token (another
        instance: the failed one is marked down).  Within a fresh first-token bound, inside the total one.
        A request for n > 1 samples resumes each unfinished sample on its own (coordinator/samples.py)."""
        log.warning("request %s: %s; resuming after %d tokens", ctx.label, failure.message,
                    sum(map(len, sent.values())))
        self.cluster.metrics.resumed.inc()
        ctx.deadline = min(ctx.total_deadline, time.monotonic() + self.cluster.config.limits.ttft_timeout_s)
        ctx.sampling.ClearField("prompt_logprobs")   # the answer has the prompt's already
        if num_samples(ctx.sampling) > 1:
            prefill = self._index("prefill")
            ctx.decode_stream = await resume_each(ctx, sent, done, lambda child: self._run(child, prefill))
            return
        ctx.resumed = list(sent.get(0, []))
        ctx.prefill, ctx.decode_stream = None, None
        ctx.recovered.discard(KV_MISSING_CODE)   # the new KV entry may be recovered from once too
        await self._run(ctx, self._index("prefill"))
