"""The one answer builder: output deltas -> GenerateResponse / OpenAI chat and completion JSON and SSE.

Whoever holds the output of a request as a sequence of `OutputDelta`s (new
token ids, the text they made safe to show, and on the last one the finish
reason) builds its answer here, so every endpoint that answers the same
request answers it the same way:

- `GenerateAnswer`: /inference/v1/generate (the coordinator's and decode's).
  Non-streamed: every output id, the finish reason ("abort" when the stream
  ended without one), usage.  Streamed: one event per delta with ids or a
  finish, usage on every event with continuous_usage_stats, a last
  empty-choices usage event with include_usage, errors in-stream, [DONE].
  `output_mode: "text"` (vLLM's GenerateText* shapes) adds each choice's text (streamed: the delta;
  a chunk also goes out for text alone) and answers logprobs with token strings.
- `OpenAIAnswer`: /v1/chat/completions and /v1/completions (the coordinator)
  and the chunk/response constructors derender uses.  Streamed chat starts
  with a role chunk; content chunks carry `usage: null` only when
  include_usage asked for a last usage chunk (OpenAI's shape).

Transport-free: routes wrap `collect()` in a JSON response and `sse()` in a
streaming one.  An exception raised by the delta iterator after the stream
started becomes an in-stream `{"error": ...}` event.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast, get_args

from pydantic import BaseModel

from services.protocol.common import Usage, now_s
from services.protocol.errors import as_epd_error
from services.protocol.generate import (
    FinishReason,
    GenerateChoice,
    GenerateResponse,
    GenerateStreamChunk,
    GenerateTextChoice,
    GenerateTextResponse,
    GenerateTextStreamChunk,
    OutputMode,
    StreamOptions,
)
from services.protocol.logprobs import (
    TokenLogprob,
    chat_logprobs,
    completion_logprobs,
    generate_logprobs,
    text_logprobs,
)
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


@dataclass(frozen=True)
class OutputDelta:
    """What one step of a request added: ids, their text, and on the last one why it ended."""

    token_ids: Sequence[int] = field(default_factory=tuple)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: Sequence[TokenLogprob] | None = None  # one per token id, when the request asked


def protocol_finish_reason(reason: str | None) -> FinishReason | None:
    """A finish reason as the protocol names it; anything unknown is reported as an error."""
    if not reason:
        return None
    return cast(FinishReason, reason) if reason in get_args(FinishReason) else "error"


def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)


class GenerateAnswer:
    """The answer of one /inference/v1/generate call."""

    def __init__(self, response_id: str, model: str | None, prompt_tokens: int,
                 options: StreamOptions | None = None, created: int | None = None,
                 output_mode: OutputMode = "tokens") -> None:
        self.response_id, self.model, self.prompt_tokens = response_id, model, prompt_tokens
        self.options, self.created = options, created if created is not None else now_s()
        self.text_mode = output_mode == "text"

    def _choice(self, delta: OutputDelta, token_ids: list[int], records: Sequence[TokenLogprob] | None,
                text: str) -> GenerateChoice:
        fields: dict[str, Any] = {"token_ids": token_ids, "stop_reason": delta.stop_reason,
                                  "finish_reason": protocol_finish_reason(delta.finish_reason)}
        if self.text_mode:
            return GenerateTextChoice(**fields, text=text,
                                      logprobs=None if records is None else text_logprobs(records))
        return GenerateChoice(**fields, logprobs=None if records is None else generate_logprobs(records))

    async def collect(self, deltas: AsyncIterator[OutputDelta]) -> GenerateResponse:
        tokens: list[int] = []
        texts: list[str] = []
        records: list[TokenLogprob] | None = None
        last = OutputDelta()
        async for delta in deltas:
            tokens.extend(delta.token_ids)
            texts.append(delta.text)
            if delta.logprobs is not None:
                records = [*(records or []), *delta.logprobs]
            if delta.finish_reason:
                last = delta
        choice = self._choice(last, tokens, records, "".join(texts))
        choice.finish_reason = choice.finish_reason or "abort"  # the stream ended without saying why
        shape: type[GenerateResponse] = GenerateTextResponse if self.text_mode else GenerateResponse
        return shape(request_id=self.response_id, model=self.model, created=self.created,
                     choices=[choice], usage=usage(self.prompt_tokens, len(tokens)))

    async def sse(self, deltas: AsyncIterator[OutputDelta]) -> AsyncIterator[bytes]:
        continuous = bool(self.options and self.options.continuous_usage_stats)
        count = 0
        try:
            async for delta in deltas:
                count += len(delta.token_ids)
                # vLLM: text mode also sends text held back for stop strings, which may come without ids
                if delta.token_ids or delta.finish_reason or (self.text_mode and delta.text):
                    choice = self._choice(delta, list(delta.token_ids), delta.logprobs, delta.text)
                    yield sse_event(self._chunk([choice], usage(self.prompt_tokens, count) if continuous else None))
            if self.options is not None and self.options.include_usage:
                yield sse_event(self._chunk([], usage(self.prompt_tokens, count)))
        except Exception as exc:  # noqa: BLE001 - after the first byte, errors travel in-stream
            yield sse_error(as_epd_error(exc))
        yield SSE_DONE

    def _chunk(self, choices: list[GenerateChoice], use: Usage | None) -> GenerateStreamChunk:
        shape: type[GenerateStreamChunk] = GenerateTextStreamChunk if self.text_mode else GenerateStreamChunk
        return shape(request_id=self.response_id, model=self.model, created=self.created,
                     choices=choices, usage=use)


class OpenAIAnswer:
    """An OpenAI chat or completion answer: whole (`collect`), streamed (`sse`), or piece by piece."""

    def __init__(self, kind: Kind, response_id: str, model: str, created: int | None = None,
                 prompt_tokens: int = 0, include_usage: bool = False,
                 prompt_token_ids: Sequence[int] | None = None, timing: RequestTiming | None = None) -> None:
        self.kind, self.response_id, self.model = kind, response_id, model
        self.created = created if created is not None else now_s()
        self.prompt_tokens, self.include_usage = prompt_tokens, include_usage
        self.prompt_token_ids = prompt_token_ids  # given: vLLM's return_token_ids (ids in the answer)
        self.timing = timing  # given: vLLM's per-request metrics in the answer (request_metrics.py)

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
            delta = DeltaMessage(content=text) if text else DeltaMessage()
            return ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason, logprobs=logprobs)
        return CompletionChoice(index=index, text=text, finish_reason=finish_reason, logprobs=logprobs)

    def chunk(self, choices: Sequence[ChatChunkChoice | CompletionChoice],
              use: Usage | None = None) -> ChatCompletionChunk | CompletionChunk:
        if self.kind == "chat":
            return ChatCompletionChunk(id=self.response_id, created=self.created, model=self.model,
                                       choices=list(cast(Sequence[ChatChunkChoice], choices)), usage=use)
        return CompletionChunk(id=self.response_id, created=self.created, model=self.model,
                               choices=list(cast(Sequence[CompletionChoice], choices)), usage=use)

    def role_chunk(self) -> ChatCompletionChunk:
        """The first chunk of a streamed chat answer."""
        role = ChatChunkChoice(delta=DeltaMessage(role="assistant", content=""))
        return ChatCompletionChunk(id=self.response_id, created=self.created, model=self.model, choices=[role])

    def logprobs(self, records: Sequence[TokenLogprob] | None, text_offset: int = 0) -> dict[str, Any] | None:
        """OpenAI's logprobs object of this kind for `records` (None: not asked)."""
        if records is None:
            return None
        return chat_logprobs(records) if self.kind == "chat" else completion_logprobs(records, text_offset)

    # ---- whole answers from deltas --------------------------------------------------------------------

    async def collect(self, deltas: AsyncIterator[OutputDelta]) -> dict[str, Any]:
        texts: list[str] = []
        token_ids: list[int] = []
        records: list[TokenLogprob] | None = None
        last = OutputDelta(finish_reason="length")
        async for delta in deltas:
            texts.append(delta.text)
            token_ids.extend(delta.token_ids)
            if self.timing is not None:
                self.timing.saw(len(delta.token_ids))
            if delta.logprobs is not None:
                records = [*(records or []), *delta.logprobs]
            if delta.finish_reason:
                last = delta
        choice = self.choice("".join(texts), last.finish_reason, last.stop_reason, self.logprobs(records))
        body = self.response([choice], usage(self.prompt_tokens, len(token_ids))).model_dump(mode="json")
        if self.prompt_token_ids is not None:  # vLLM's extension: exact ids for clients that compare tokens
            body["choices"][0]["token_ids"] = token_ids
            body["prompt_token_ids"] = list(self.prompt_token_ids)
        if self.timing is not None:
            body["metrics"] = self.timing.metrics()
        return body

    async def sse(self, deltas: AsyncIterator[OutputDelta]) -> AsyncIterator[bytes]:
        completion = 0
        pending: list[TokenLogprob] | None = None  # of tokens whose text is still held back
        offset = 0  # completions' text_offset: where the next chunk's text starts
        # A chat stream's role chunk goes out in one write with the first event after it (the first token's, which
        # the coordinator already holds when the stream starts): one wake-up of the client for both.
        held = self._event(self.role_chunk()) if self.kind == "chat" else b""
        try:
            async for delta in deltas:
                completion += len(delta.token_ids)
                if self.timing is not None:
                    self.timing.saw(len(delta.token_ids))
                if delta.logprobs is not None:
                    pending = [*(pending or []), *delta.logprobs]
                if delta.text or delta.finish_reason:
                    choice = self.delta_choice(delta.text, delta.finish_reason or None, self.logprobs(pending, offset))
                    pending, offset = None, offset + len(delta.text)
                    event, held = held + self._event(self.chunk([choice])), b""
                    yield event
            if held:   # no event came (no delta at all): the role chunk alone
                event, held = held, b""
                yield event
            if self.include_usage:  # vLLM: per-request metrics ride on this final usage chunk only
                last = self.chunk([], usage(self.prompt_tokens, completion))
                if self.timing is None:
                    yield self._event(last)
                else:
                    yield sse_event({**last.model_dump(mode="json"), "metrics": self.timing.metrics()})
        except Exception as exc:  # noqa: BLE001 - every failure after the first byte becomes an in-stream error
            yield held + sse_error(as_epd_error(exc))
        yield SSE_DONE

    def _event(self, chunk: BaseModel) -> bytes:
        if self.include_usage:
            return sse_event(chunk)
        return b"data: " + chunk.model_dump_json(exclude={"usage"}).encode("utf-8") + b"\n\n"
