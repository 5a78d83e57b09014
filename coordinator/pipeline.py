"""The ordered pipeline: render -> encode -> prefill, then the decode stream.

Adding a step is one file in steps/ and one line here.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from services.rpc.v1 import epd_pb2 as pb

from .cluster import Cluster
from .context import RequestContext
from .steps.base import Step
from .steps.decode import DecodeStep
from .steps.encode import EncodeStep
from .steps.prefill import PrefillStep
from .steps.render import RenderStep


class Pipeline:
    def __init__(self, cluster: Cluster) -> None:
        encode = EncodeStep(cluster)
        self.cluster = cluster
        self.steps: list[Step] = [RenderStep(cluster), encode, PrefillStep(cluster, encode)]
        self.decode = DecodeStep(cluster)

    async def prepare(self, ctx: RequestContext) -> None:
        """Run every step before decode; each records its own timing."""
        for step in self.steps:
            await step.execute(ctx)
            if step.name in ctx.timings:
                self.cluster.metrics.stage_seconds.labels(step.name).observe(ctx.timings[step.name])

    async def stream(self, ctx: RequestContext) -> AsyncIterator[pb.DecodeChunk]:
        started = time.monotonic()
        first = True
        async for chunk in self.decode.stream(ctx):
            if first:
                self.cluster.metrics.ttft_seconds.observe(time.monotonic() - started + _prepare_time(ctx))
                first = False
            yield chunk


def _prepare_time(ctx: RequestContext) -> float:
    return sum(ctx.timings.get(name, 0.0) for name in ("render", "encode", "prefill"))
