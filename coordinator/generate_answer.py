"""GenerateResponse and its SSE form, built from the decode step's chunks (PROTOCOL.md shapes).

Non-streamed: all output token ids (the first, sampled by prefill, included),
the finish reason, usage.  Streamed: one `data:` event per chunk with the
token_ids delta, usage on every event with continuous_usage_stats, a last
event with empty choices and usage with include_usage, errors in-stream as
`data: {"error": ...}`, then `data: [DONE]`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import cast, get_args

from services.protocol.common import Usage
from services.protocol.errors import as_epd_error
from services.protocol.generate import (
    FinishReason,
    GenerateChoice,
    GenerateResponse,
    GenerateStreamChunk,
    StreamOptions,
)
from services.protocol.sampling import SamplingParams
from services.protocol.streaming import SSE_DONE, sse_error, sse_event
from services.rpc.v1 import epd_pb2 as pb

from .context import RequestContext


def finish_reason(text: str) -> FinishReason | None:
    """gRPC carries it as text ("" while running); anything unknown is reported as an error."""
    for known in get_args(FinishReason):
        if text == known:
            return cast(FinishReason, known)
    return "error" if text else None


def stop_reason(text: str, sampling: SamplingParams) -> int | str | None:
    """gRPC carries stop_reason as text; give a stop token id back as an int (as decode answers it)."""
    if not text:
        return None
    if text.isdigit() and int(text) in sampling.stop_token_ids and text not in sampling.stop:
        return int(text)
    return text


class GenerateAnswer:
    """The answer of one coordinator generate call."""

    def __init__(self, ctx: RequestContext, response_id: str, model: str) -> None:
        assert ctx.generate is not None
        self.ctx, self.response_id, self.model = ctx, response_id, model
        self.sampling = ctx.generate.sampling_params
        self.options: StreamOptions | None = ctx.generate.stream_options

    def _usage(self, completion_tokens: int) -> Usage:
        prompt = self.ctx.prefill.prompt_tokens if self.ctx.prefill is not None else 0
        return Usage(prompt_tokens=prompt, completion_tokens=completion_tokens)

    def _choice(self, chunk: pb.DecodeChunk, token_ids: list[int]) -> GenerateChoice:
        return GenerateChoice(token_ids=token_ids, finish_reason=finish_reason(chunk.finish_reason),
                              stop_reason=stop_reason(chunk.stop_reason, self.sampling))

    async def collect(self, chunks: AsyncIterator[pb.DecodeChunk]) -> GenerateResponse:
        tokens: list[int] = []
        last = pb.DecodeChunk()
        async for chunk in chunks:
            tokens.extend(chunk.token_ids)
            if chunk.finish_reason:
                last = chunk
        choice = self._choice(last, tokens)
        if choice.finish_reason is None:
            choice.finish_reason = "abort"  # the stream ended without saying why
        return GenerateResponse(request_id=self.response_id, model=self.model, choices=[choice],
                                usage=self._usage(len(tokens)), created=self.ctx.created)

    async def sse(self, chunks: AsyncIterator[pb.DecodeChunk]) -> AsyncIterator[bytes]:
        continuous = bool(self.options and self.options.continuous_usage_stats)
        count = 0
        try:
            async for chunk in chunks:
                count += len(chunk.token_ids)
                if chunk.token_ids or chunk.finish_reason:
                    yield sse_event(self._chunk([self._choice(chunk, list(chunk.token_ids))],
                                                self._usage(count) if continuous else None))
            if self.options is not None and self.options.include_usage:
                yield sse_event(self._chunk([], self._usage(count)))
        except Exception as exc:  # noqa: BLE001 - after the first byte, errors travel in-stream
            yield sse_error(as_epd_error(exc))
        yield SSE_DONE

    def _chunk(self, choices: list[GenerateChoice], usage: Usage | None) -> GenerateStreamChunk:
        return GenerateStreamChunk(request_id=self.response_id, model=self.model, created=self.ctx.created,
                                   choices=choices, usage=usage)
