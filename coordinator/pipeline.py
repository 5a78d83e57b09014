"""The ordered pipeline: generate input -> render -> encode -> prefill -> decode (opened), then the stream.

One straight line: `prepare` runs the steps in order over one RequestContext;
each step reads and writes only its rows of the context table (context.py)
and never calls another step.  What happens when a stage finds an entry gone
is one policy, here (RECOVERIES): the error code names the step to run again
from and what to forget first, and each code is recovered from once per
request; failover between instances of one role is the one loop in
clients.py, inside a step.

While a step waits for its role, the later steps may open their calls ahead
of their inputs (Step.open_ahead, coordinator/ahead.py); every one not used
is cancelled when `prepare` ends or a recovery runs.

Adding a step is one file in steps/ and one line in STEPS.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

from services import activity
from services.protocol.answers import OutputDelta
from services.protocol.errors import EpdError, InternalError

from . import inflight
from .cluster import Cluster
from .context import RequestContext
from .steps.base import Step
from .steps.decode import DecodeStep
from .steps.encode import EncodeStep
from .steps.generate_input import GenerateInputStep
from .steps.prefill import PrefillStep
from .steps.render import RenderStep

log = logging.getLogger(__name__)
S = TypeVar("S", bound=Step)
STEPS: list[type[Step]] = [GenerateInputStep, RenderStep, EncodeStep, PrefillStep, DecodeStep]
EC_MISSING_CODE = "ec_entry_missing"
KV_MISSING_CODE = "kv_entry_missing"
MM_MISSING_CODE = "mm_entry_missing"


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
        loop = asyncio.get_running_loop()
        index = 0
        try:
            while index < len(self.steps):
                step = self.steps[index]
                activity.mark(f"coordinator.{step.name}.start")
                ctx.running = step.name
                if index + 1 < len(self.steps):
                    loop.call_soon(self._open_ahead, ctx, index)  # runs once the step waits (its call sent)
                try:
                    await step.execute(ctx)
                except EpdError as exc:
                    self.cancel_ahead(ctx)   # opened from the context as it was: a recovery changes it
                    index = self._recover(step, ctx, exc)
                    continue
                activity.mark(f"coordinator.{step.name}.end")
                if step.name in ctx.timings:
                    self.cluster.metrics.stage_seconds.labels(step.name).observe(ctx.timings[step.name])
                index += 1
        finally:
            ctx.running = ""
            self.cancel_ahead(ctx)

    def _open_ahead(self, ctx: RequestContext, index: int) -> None:
        """The later steps' calls, opened ahead of their inputs while the step at `index` waits
        (coordinator/ahead.py); nothing when that step is over already (it had nothing to wait for)."""
        if ctx.running != self.steps[index].name:
            return
        if self._ahead_pays():
            for step in self.steps[index + 1:]:
                try:
                    step.open_ahead(ctx)
                except Exception:  # noqa: BLE001 - a callback: the step makes a whole call instead
                    log.exception("opening the %s call ahead failed", step.name)
        if ctx.rendered is not None and ctx.while_waiting:   # the route's own work for after the first token
            work, ctx.while_waiting = ctx.while_waiting, []
            for do in work:
                try:
                    do()
                except Exception:  # noqa: BLE001 - a callback: the route does it after the first token instead
                    log.exception("work ahead of the first token failed")

    def _ahead_pays(self) -> bool:
        """One request at a time a call opened ahead takes its hand-offs off the request's path; under load the
        stages' waits overlap other requests' work anyway, and its extra frames and handler steps (the CPU per
        request `python -m benchmarks.overhead --compare-ref` reports) would only cost throughput."""
        limit = self.cluster.config.ahead_max_inflight
        running = inflight.running_now()
        return limit > 0 and (running is None or running <= limit)

    @staticmethod
    def cancel_ahead(ctx: RequestContext) -> None:
        for ahead in ctx.ahead.values():
            ahead.cancel()
        ctx.ahead.clear()

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
        """The decode stream `prepare` opened, as answer deltas; records TTFT and the decode time."""
        if ctx.decode_stream is None:
            raise InternalError("the pipeline was not prepared", code="internal_error")
        started, first = time.perf_counter(), True
        try:
            async for delta in ctx.decode_stream.chunks():
                if first:
                    activity.mark("coordinator.first_delta")
                    self.cluster.metrics.ttft_seconds.observe(time.monotonic() - ctx.started)
                    first = False
                yield delta
        finally:
            ctx.decode_stream.close()
            ctx.timings["decode"] = ctx.timings.get("decode_first_chunk", 0.0) + time.perf_counter() - started
            self.cluster.metrics.stage_seconds.labels("decode").observe(ctx.timings["decode"])
