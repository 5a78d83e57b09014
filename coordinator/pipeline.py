"""The ordered pipeline: render -> encode -> prefill -> decode (opened), then the decode stream.

Adding a step is one file in steps/ and one line here.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from services.rpc.v1 import epd_pb2 as pb

from . import inflight
from .cluster import Cluster
from .context import RequestContext
from .steps.base import Step
from .steps.decode import DecodeStep
from .steps.encode import EncodeStep
from .steps.generate_input import GenerateInputStep
from .steps.prefill import PrefillStep
from .steps.render import RenderStep


class Pipeline:
    def __init__(self, cluster: Cluster) -> None:
        encode = EncodeStep(cluster)
        prefill = PrefillStep(cluster, encode)
        self.cluster = cluster
        self.decode = DecodeStep(cluster, prefill)
        # decode last: it opens the stream and reads the first chunk (decode.py says why).
        self.steps: list[Step] = [GenerateInputStep(cluster), RenderStep(cluster), encode, prefill,
                                  self.decode]

    async def prepare(self, ctx: RequestContext) -> None:
        """Run every step up to the decode stream's first chunk; each records its own timing."""
        inflight.bind(ctx.request_id)  # POST /abort_requests can cancel it from now on
        for step in self.steps:
            await step.execute(ctx)
            if step.name in ctx.timings:
                self.cluster.metrics.stage_seconds.labels(step.name).observe(ctx.timings[step.name])

    async def stream(self, ctx: RequestContext) -> AsyncIterator[pb.DecodeChunk]:
        first = True
        try:
            async for chunk in self.decode.stream(ctx):
                if first:
                    self.cluster.metrics.ttft_seconds.observe(time.monotonic() - ctx.started)
                    first = False
                yield chunk
        finally:
            if "decode" in ctx.timings:
                self.cluster.metrics.stage_seconds.labels("decode").observe(ctx.timings["decode"])
