"""The one answer builder: output deltas -> GenerateResponse / OpenAI chat and completion JSON and SSE.

Whoever holds the output of a request as a sequence of `OutputDelta`s (new
token ids, the text they made safe to show, and on each sample's last one the
finish reason) builds its answer here, so every endpoint that answers the same
request answers it the same way.  A request for n samples (sampling_params.n)
sends the deltas of all its samples, each naming its sample (`index`), in any
interleaving; every answer has one choice per sample, in index order.

- `GenerateAnswer`: /inference/v1/generate (the coordinator's and decode's).
  Non-streamed: every output id per choice, the finish reason ("abort" when
  the stream ended without one), usage (completion tokens of all samples).
  Streamed: one event per delta with ids or a finish, usage on every event
  with continuous_usage_stats (that sample's count), a last empty-choices usage
  event with include_usage, errors in-stream, [DONE].  `output_mode: "text"`
  (vLLM's GenerateText* shapes) adds each choice's text and answers logprobs
  with token strings.
- `OpenAIAnswer` (openai_answer.py): /v1/chat/completions and /v1/completions.

Every choice says which weights made its tokens: vLLM's `weight_versions`, contiguous spans
[{"version", "start", "end"}] over the output indexes, on the whole answer and on a streamed choice's
final chunk (each delta carries the version decode reported, `weight_version`).  `prompt_logprobs`
(prefill's records, vLLM's `list[dict[token id, Logprob] | None]`) ride on the non-streamed answer.

Transport-free: routes wrap `collect()` in a JSON response and `sse()` in a
streaming one.  An exception raised by the delta iterator after the stream
started becomes an in-stream `{"error": ...}` event.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from services.protocol.common import Usage, now_s
from services.protocol.deltas import OutputDelta, Sample, VersionSpans, gather, protocol_finish_reason, usage
from services.protocol.errors import as_epd_error
from services.protocol.generate import (
    GenerateChoice,
    GenerateResponse,
    GenerateStreamChunk,
    GenerateTextChoice,
    GenerateTextResponse,
    GenerateTextStreamChunk,
    OutputMode,
    StreamOptions,
)
from services.protocol.logprobs import TokenLogprob, generate_logprobs, text_logprobs
from services.protocol.openai_answer import Kind, OpenAIAnswer
from services.protocol.streaming import SSE_DONE, sse_error, sse_event


class GenerateAnswer:
    """The answer of one /inference/v1/generate call."""

    def __init__(self, response_id: str, model: str | None, prompt_tokens: int,
                 options: StreamOptions | None = None, created: int | None = None,
                 output_mode: OutputMode = "tokens", samples: int = 1,
                 prompt_logprobs: list[Any] | None = None, as_token_ids: bool = False) -> None:
        self.response_id, self.model, self.prompt_tokens = response_id, model, prompt_tokens
        self.options, self.created = options, created if created is not None else now_s()
        self.text_mode = output_mode == "text"
        self.samples, self.prompt_logprobs, self.as_token_ids = samples, prompt_logprobs, as_token_ids

    def _choice(self, index: int, delta: OutputDelta, token_ids: list[int], records: Sequence[TokenLogprob] | None,
                text: str, versions: list[dict[str, Any]] | None) -> GenerateChoice:
        fields: dict[str, Any] = {"index": index, "token_ids": token_ids, "stop_reason": delta.stop_reason,
                                  "finish_reason": protocol_finish_reason(delta.finish_reason),
                                  "weight_versions": versions}
        if self.text_mode:
            return GenerateTextChoice(**fields, text=text, logprobs=None if records is None
                                      else text_logprobs(records, self.as_token_ids))
        return GenerateChoice(**fields, logprobs=None if records is None else generate_logprobs(records))

    async def collect(self, deltas: AsyncIterator[OutputDelta]) -> GenerateResponse:
        outputs = await gather(deltas, self.samples)
        choices = []
        for index, sample in enumerate(outputs):
            choice = self._choice(index, sample.last or OutputDelta(), sample.token_ids, sample.records, sample.text,
                                  sample.versions.value())
            choice.finish_reason = choice.finish_reason or "abort"  # the stream ended without saying why
            choices.append(choice)
        shape: type[GenerateResponse] = GenerateTextResponse if self.text_mode else GenerateResponse
        total = sum(len(sample.token_ids) for sample in outputs)
        return shape(request_id=self.response_id, model=self.model, created=self.created, choices=choices,
                     usage=usage(self.prompt_tokens, total), prompt_logprobs=self.prompt_logprobs)

    async def sse(self, deltas: AsyncIterator[OutputDelta]) -> AsyncIterator[bytes]:
        continuous = bool(self.options and self.options.continuous_usage_stats)
        counts: dict[int, int] = {}
        versions: dict[int, VersionSpans] = {}
        try:
            async for delta in deltas:
                counts[delta.index] = counts.get(delta.index, 0) + len(delta.token_ids)
                spans = versions.setdefault(delta.index, VersionSpans())
                spans.add(delta.weight_version, len(delta.token_ids))
                # vLLM: text mode also sends text held back for stop strings, which may come without ids
                if delta.token_ids or delta.finish_reason or (self.text_mode and delta.text):
                    final = spans.value() if delta.finish_reason else None   # vLLM: on the final chunk only
                    choice = self._choice(delta.index, delta, list(delta.token_ids), delta.logprobs, delta.text, final)
                    use = usage(self.prompt_tokens, counts[delta.index]) if continuous else None
                    yield sse_event(self._chunk([choice], use))
            if self.options is not None and self.options.include_usage:
                yield sse_event(self._chunk([], usage(self.prompt_tokens, sum(counts.values()))))
        except Exception as exc:  # noqa: BLE001 - after the first byte, errors travel in-stream
            yield sse_error(as_epd_error(exc))
        yield SSE_DONE

    def _chunk(self, choices: list[GenerateChoice], use: Usage | None) -> GenerateStreamChunk:
        shape: type[GenerateStreamChunk] = GenerateTextStreamChunk if self.text_mode else GenerateStreamChunk
        return shape(request_id=self.response_id, model=self.model, created=self.created,
                     choices=choices, usage=use)


__all__ = ["GenerateAnswer", "Kind", "OpenAIAnswer", "OutputDelta", "Sample", "VersionSpans", "gather",
           "protocol_finish_reason", "usage"]
