"""OpenAI chat and completion answers from output deltas: whole (`collect`), streamed (`sse`), or in pieces.

/v1/chat/completions and /v1/completions (the coordinator, decode's llm-d call) and the chunk/response
constructors derender uses.  A request for n samples answers n choices, index by index; streamed, chat
starts with one role chunk per choice (vLLM's order) and every later chunk carries its choice's index.
Content chunks carry `usage: null` only when include_usage asked for a last usage chunk (OpenAI's
shape).  vLLM's extensions: `prompt_logprobs` (chat: on the answer; completions: on each choice),
per-choice `token_ids` with return_token_ids, logprobs naming tokens `token_id:<id>` with
return_tokens_as_token_ids, and each choice's `weight_versions` (answers.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal, cast

from pydantic import BaseModel

from services.protocol.common import Usage, now_s
from services.protocol.deltas import OutputDelta, Sample, VersionSpans, gather, usage
from services.protocol.errors import as_epd_error
from services.protocol.logprobs import TokenLogprob, as_token_ids, chat_logprobs, completion_logprobs
from services.protocol.openai_responses import (
    ChatChunkChoice,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionChunk,
    CompletionResponse,
    DeltaMessage,
)
from services.protocol.request_metrics import RequestTiming
from services.protocol.streaming import SSE_DONE, sse_error, sse_event

Kind = Literal["chat", "completion"]


class _Choices:
    """A streamed answer's per-choice state: logprobs of text still held back, text offsets, counts, versions."""

    def __init__(self) -> None:
        self.pending: dict[int, list[TokenLogprob]] = {}
        self.offset: dict[int, int] = {}
        self.count: dict[int, int] = {}
        self.versions: dict[int, VersionSpans] = {}

    def add(self, delta: OutputDelta) -> None:
        index = delta.index
        self.count[index] = self.count.get(index, 0) + len(delta.token_ids)
        self.versions.setdefault(index, VersionSpans()).add(delta.weight_version, len(delta.token_ids))
        if delta.logprobs is not None:
            self.pending[index] = [*self.pending.get(index, []), *delta.logprobs]

    def take(self, delta: OutputDelta) -> tuple[list[TokenLogprob] | None, int]:
        """The logprobs the chunk of `delta` carries (None: not asked) and where its first token's text starts."""
        return self.pending.pop(delta.index, None), self.offset.get(delta.index, 0)

    def advance(self, index: int, logprobs: dict[str, Any] | None) -> None:
        """vLLM: the next chunk's offset follows the tokens just reported, not the text (held-back text lags)."""
        if logprobs is not None and logprobs.get("tokens"):
            self.offset[index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])


class OpenAIAnswer:
    """An OpenAI chat or completion answer: whole (`collect`), streamed (`sse`), or piece by piece."""

    def __init__(self, kind: Kind, response_id: str, model: str, created: int | None = None,
                 prompt_tokens: int = 0, include_usage: bool = False,
                 prompt_token_ids: Sequence[int] | None = None, timing: RequestTiming | None = None,
                 samples: int = 1, prompt_logprobs: list[Any] | None = None, as_token_ids: bool = False) -> None:
        self.kind, self.response_id, self.model = kind, response_id, model
        self.created = created if created is not None else now_s()
        self.prompt_tokens, self.include_usage = prompt_tokens, include_usage
        self.prompt_token_ids = prompt_token_ids  # given: vLLM's return_token_ids (ids in the answer)
        self.timing = timing  # given: vLLM's per-request metrics in the answer (request_metrics.py)
        self.samples, self.prompt_logprobs, self.as_token_ids = samples, prompt_logprobs, as_token_ids

    # ---- pieces (derender builds its answers from these) ----------------------------------------------

    def choice(self, text: str, finish_reason: str | None, stop_reason: int | str | None = None,
               logprobs: Any = None, index: int = 0) -> ChatCompletionChoice | CompletionChoice:
        if self.kind == "chat":
            return ChatCompletionChoice(index=index, message=ChatResponseMessage(content=text),
                                        finish_reason=finish_reason, stop_reason=stop_reason, logprobs=logprobs)
        return CompletionChoice(index=index, text=text, finish_reason=finish_reason, stop_reason=stop_reason,
                                logprobs=logprobs)

    def response(self, choices: Sequence[ChatCompletionChoice | CompletionChoice],
                 use: Usage) -> ChatCompletionResponse | CompletionResponse:
        if self.kind == "chat":
            return ChatCompletionResponse(id=self.response_id, created=self.created, model=self.model,
                                          choices=list(cast(Sequence[ChatCompletionChoice], choices)), usage=use)
        return CompletionResponse(id=self.response_id, created=self.created, model=self.model,
                                  choices=list(cast(Sequence[CompletionChoice], choices)), usage=use)

    def delta_choice(self, text: str, finish_reason: str | None, logprobs: Any = None,
                     index: int = 0) -> ChatChunkChoice | CompletionChoice:
        if self.kind == "chat":
            delta = DeltaMessage(content=text)   # vLLM: content "" on a chunk whose text is held back
            return ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason, logprobs=logprobs)
        return CompletionChoice(index=index, text=text, finish_reason=finish_reason, logprobs=logprobs)

    def chunk(self, choices: Sequence[ChatChunkChoice | CompletionChoice],
              use: Usage | None = None) -> ChatCompletionChunk | CompletionChunk:
        if self.kind == "chat":
            return ChatCompletionChunk(id=self.response_id, created=self.created, model=self.model,
                                       choices=list(cast(Sequence[ChatChunkChoice], choices)), usage=use)
        return CompletionChunk(id=self.response_id, created=self.created, model=self.model,
                               choices=list(cast(Sequence[CompletionChoice], choices)), usage=use)

    def role_chunk(self, index: int = 0) -> ChatCompletionChunk:
        """The first chunk of a streamed chat answer's choice `index`."""
        role = ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))
        return ChatCompletionChunk(id=self.response_id, created=self.created, model=self.model, choices=[role])

    def logprobs(self, records: Sequence[TokenLogprob] | None, text_offset: int = 0) -> dict[str, Any] | None:
        """OpenAI's logprobs object of this kind for `records` (None: not asked)."""
        if records is None:
            return None
        if self.kind == "chat":
            return chat_logprobs(records, self.as_token_ids)
        return completion_logprobs(as_token_ids(records) if self.as_token_ids else records, text_offset)

    # ---- whole answers from deltas --------------------------------------------------------------------

    async def collect(self, deltas: AsyncIterator[OutputDelta]) -> dict[str, Any]:
        timing = self.timing
        outputs = await gather(deltas, self.samples, None if timing is None else lambda d: timing.saw(len(d.token_ids)))
        choices = [self._whole_choice(index, sample) for index, sample in enumerate(outputs)]
        total = sum(len(sample.token_ids) for sample in outputs)
        body = self.response(choices, usage(self.prompt_tokens, total)).model_dump(mode="json")
        for index, sample in enumerate(outputs):
            extra = body["choices"][index]
            if sample.versions.spans:
                extra["weight_versions"] = sample.versions.value()
            if self.prompt_token_ids is not None:  # vLLM's extension: exact ids for clients that compare tokens
                extra["token_ids"] = sample.token_ids
            if self.kind == "completion" and self.prompt_logprobs is not None:
                extra["prompt_logprobs"] = self.prompt_logprobs
        if self.prompt_token_ids is not None:
            body["prompt_token_ids"] = list(self.prompt_token_ids)
        if self.kind == "chat" and self.prompt_logprobs is not None:
            body["prompt_logprobs"] = self.prompt_logprobs
        if self.timing is not None:
            body["metrics"] = self.timing.metrics()
        return body

    def _whole_choice(self, index: int, sample: Sample) -> ChatCompletionChoice | CompletionChoice:
        last = sample.last or OutputDelta(finish_reason="length")
        return self.choice(sample.text, last.finish_reason, last.stop_reason, self.logprobs(sample.records), index)

    async def sse(self, deltas: AsyncIterator[OutputDelta]) -> AsyncIterator[bytes]:
        state = _Choices()
        # A chat stream's role chunks go out in one write with the first event after them (the first token's,
        # which the coordinator already holds when the stream starts): one wake-up of the client for all.
        held = b"".join(self._event(self.role_chunk(i)) for i in range(self.samples)) if self.kind == "chat" else b""
        try:
            async for delta in deltas:
                state.add(delta)
                if self.timing is not None:
                    self.timing.saw(len(delta.token_ids))
                # vLLM: every generated token gets its chunk, with empty text while decode holds the text back
                # (an incomplete character, a possible stop string); clients time the first token by it
                if delta.token_ids or delta.text or delta.finish_reason:
                    event, held = held + self._delta_event(delta, state), b""
                    yield event
            if held:   # no event came (no delta at all): the role chunks alone
                event, held = held, b""
                yield event
            if self.include_usage:  # vLLM: per-request metrics ride on this final usage chunk only
                last = self.chunk([], usage(self.prompt_tokens, sum(state.count.values())))
                if self.timing is None:
                    yield self._event(last)
                else:
                    yield sse_event({**last.model_dump(mode="json"), "metrics": self.timing.metrics()})
        except Exception as exc:  # noqa: BLE001 - every failure after the first byte becomes an in-stream error
            yield held + sse_error(as_epd_error(exc))
        yield SSE_DONE

    def _delta_event(self, delta: OutputDelta, state: _Choices) -> bytes:
        records, offset = state.take(delta)
        logprobs = self.logprobs(records, offset)
        if self.kind == "completion":
            state.advance(delta.index, logprobs)
        choice = self.delta_choice(delta.text, delta.finish_reason or None, logprobs, delta.index)
        versions = state.versions[delta.index].value() if delta.finish_reason else None
        if versions is None:
            return self._event(self.chunk([choice]))
        body = self.chunk([choice]).model_dump(mode="json")
        if not self.include_usage:
            body.pop("usage", None)
        body["choices"][0]["weight_versions"] = versions   # a choice's final chunk (vLLM's place for them)
        return sse_event(body)

    def _event(self, chunk: BaseModel) -> bytes:
        if self.include_usage:
            return sse_event(chunk)
        return b"data: " + chunk.model_dump_json(exclude={"usage"}).encode("utf-8") + b"\n\n"
