"""Streaming derender answers in vLLM's shape: one chunk per call.

epd's streaming derender answers `chunks` (zero or more: the role chunk, a content chunk, a usage
chunk); vLLM's answers exactly one `chunk`.  For a body in vLLM's shape (`generate_chunk`) the step's
chunks are merged: the role of the first, the texts joined, the last finish_reason, the usage if any;
a step that produced nothing (text held back) is one chunk with an empty delta, as vLLM sends.
"""

from __future__ import annotations

from services.protocol.derender_stream import (
    ChatDerenderStreamResponse,
    CompletionDerenderStreamResponse,
    VllmChatDerenderStreamResponse,
    VllmCompletionDerenderStreamResponse,
)
from services.protocol.openai_responses import (
    ChatChunkChoice,
    ChatCompletionChunk,
    CompletionChoice,
    CompletionChunk,
    DeltaMessage,
)


def as_vllm_chat(answer: ChatDerenderStreamResponse) -> VllmChatDerenderStreamResponse:
    state, chunks = answer.stream_state, answer.chunks
    choices = [c for chunk in chunks for c in chunk.choices]
    usage = next((chunk.usage for chunk in reversed(chunks) if chunk.usage is not None), None)
    merged: list[ChatChunkChoice] = []
    if choices or usage is None:
        role = next((c.delta.role for c in choices if c.delta.role), None)
        text = "".join(c.delta.content or "" for c in choices)
        last = choices[-1] if choices else ChatChunkChoice()
        merged = [ChatChunkChoice(delta=DeltaMessage(role=role, content=text), finish_reason=last.finish_reason,
                                  logprobs=last.logprobs)]
    chunk = ChatCompletionChunk(id=state.id, created=state.created, model=state.model, choices=merged, usage=usage)
    return VllmChatDerenderStreamResponse(chunk=chunk, stream_state=state)


def as_vllm_completion(answer: CompletionDerenderStreamResponse) -> VllmCompletionDerenderStreamResponse:
    state, chunks = answer.stream_state, answer.chunks
    choices = [c for chunk in chunks for c in chunk.choices]
    usage = next((chunk.usage for chunk in reversed(chunks) if chunk.usage is not None), None)
    merged: list[CompletionChoice] = []
    if choices or usage is None:
        last = choices[-1] if choices else CompletionChoice()
        merged = [CompletionChoice(text="".join(c.text for c in choices), finish_reason=last.finish_reason,
                                   stop_reason=last.stop_reason, logprobs=last.logprobs)]
    chunk = CompletionChunk(id=state.id, created=state.created, model=state.model, choices=merged, usage=usage)
    return VllmCompletionDerenderStreamResponse(chunk=chunk, stream_state=state)
