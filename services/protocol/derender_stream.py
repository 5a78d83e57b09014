"""Streaming derender: one generate SSE chunk in, OpenAI stream chunks out, state carried by the caller.

Render keeps no per-request state, so a caller turning a streamed generate
answer into a streamed OpenAI answer posts each generate chunk to
/v1/chat/completions/derender (or /v1/completions/derender) with
`"stream": true` and the `stream_state` of the previous answer (null on the
first call).  Each answer holds the OpenAI chunks to forward (possibly none:
text held back until a multi-byte character or a possible stop string
resolves) and the new `stream_state`.  The state is small (the incremental
detokenizer's short window, the held stop-string prefix, counters, the stream
id) and the caller treats it as opaque; render validates its shape.

vLLM's own body shape is accepted too: `generate_chunk` (one generate SSE event) instead of
`generate_response` / `generate_responses`, `prompt_tokens` as a single count.  Such a call is answered
in vLLM's shape, `{"chunk": <one OpenAI chunk>, "stream_state": ...}`: epd's chunks of that step merged
into one (role and text deltas joined; a step that only holds text back gives a chunk with an empty
delta).  vLLM's DerenderStreamState model validates epd's state (all its fields have defaults).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, PrivateAttr, model_validator

from services.protocol.common import ProtocolModel, TokenId
from services.protocol.derender import ChatDerenderRequest, CompletionDerenderRequest
from services.protocol.openai_responses import ChatCompletionChunk, CompletionChunk


class OutputState(ProtocolModel):
    """Where the text of one output sequence stands."""

    window: list[TokenId] = Field(default_factory=list, description="Detokenizer window (ids not yet "
                                  "settled, plus a few of context).")
    read: int = Field(default=0, ge=0, description="Window index of the first id whose text is not sent.")
    held: str = Field(default="", description="Text held back because it may start a stop string.")
    num_tokens: int = Field(default=0, ge=0, description="Output tokens seen so far.")
    finish_reason: str | None = Field(default=None, description="Set once the sequence ended.")
    stop_reason: int | str | None = Field(default=None, description="The matched stop, once ended.")

    @model_validator(mode="after")
    def _read_within_window(self) -> OutputState:
        if self.read > len(self.window):
            raise ValueError(f"read ({self.read}) exceeds the window length ({len(self.window)})")
        return self


class DerenderStreamState(ProtocolModel):
    """What a streaming derender caller carries from one call to the next."""

    id: str = Field(min_length=1, description="The OpenAI stream id every chunk carries.")
    created: int = Field(ge=0, description="Unix seconds, the same on every chunk.")
    model: str = Field(description="Model name every chunk carries.")
    outputs: list[OutputState] = Field(min_length=1, description="One per choice (one per prompt for "
                                       "completions).")


class _StreamFields(ProtocolModel):
    stream: bool = Field(default=False, description="Derender one generate stream chunk (see module doc).")
    stream_state: DerenderStreamState | None = Field(
        default=None, description="The previous answer's stream_state; null on the first chunk.")
    _vllm_shape: bool = PrivateAttr(default=False)

    @property
    def vllm_shape(self) -> bool:
        """True when the body came in vLLM's shape (generate_chunk): answer with one `chunk`."""
        return self._vllm_shape


class ChatDerenderStreamRequest(ChatDerenderRequest, _StreamFields):
    """A chat derender body; with stream=true, generate_response is one generate stream chunk."""

    @model_validator(mode="wrap")
    @classmethod
    def _accept_vllm_shape(cls, data: Any, handler: Any) -> Any:
        vllm = isinstance(data, dict) and "generate_chunk" in data and "generate_response" not in data
        if vllm:
            data = {**{k: v for k, v in data.items() if k != "generate_chunk"},
                    "generate_response": data["generate_chunk"]}
        instance = handler(data)
        instance._vllm_shape = vllm
        return instance


class CompletionDerenderStreamRequest(CompletionDerenderRequest, _StreamFields):
    """A completion derender body; with stream=true, generate_responses holds one chunk per prompt."""

    @model_validator(mode="wrap")
    @classmethod
    def _accept_vllm_shape(cls, data: Any, handler: Any) -> Any:
        vllm = isinstance(data, dict) and "generate_chunk" in data and "generate_responses" not in data
        if vllm:
            prompt = data.get("prompt_tokens")
            data = {**{k: v for k, v in data.items() if k not in ("generate_chunk", "prompt_tokens")},
                    "generate_responses": [data["generate_chunk"]],
                    "prompt_tokens": [prompt if prompt is not None else data.get("prompt_token_ids") or 0]}
        instance = handler(data)
        instance._vllm_shape = vllm
        return instance


class ChatDerenderStreamResponse(ProtocolModel):
    chunks: list[ChatCompletionChunk] = Field(description="OpenAI chunks to send, in order (may be empty).")
    stream_state: DerenderStreamState = Field(description="Carry into the next call.")


class CompletionDerenderStreamResponse(ProtocolModel):
    chunks: list[CompletionChunk] = Field(description="OpenAI chunks to send, in order (may be empty).")
    stream_state: DerenderStreamState = Field(description="Carry into the next call.")


class VllmChatDerenderStreamResponse(ProtocolModel):
    """vLLM's DerenderChatStreamResponse: one chunk per call."""

    chunk: ChatCompletionChunk = Field(description="The step's chunks merged into one.")
    stream_state: DerenderStreamState = Field(description="Carry into the next call.")


class VllmCompletionDerenderStreamResponse(ProtocolModel):
    """vLLM's DerenderCompletionStreamResponse: one chunk per call."""

    chunk: CompletionChunk = Field(description="The step's chunks merged into one.")
    stream_state: DerenderStreamState = Field(description="Carry into the next call.")
