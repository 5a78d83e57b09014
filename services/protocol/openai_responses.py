"""OpenAI response bodies: completions, their stream chunks, the model list, errors.

Shapes follow the OpenAI API as vLLM serves it.  Stream deltas drop unset
fields (`{"content": "x"}`, not `{"role": null, "content": "x"}`), while
finish_reason stays present as null, as OpenAI clients expect.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_serializer

from services.protocol.common import ProtocolModel, Usage, fresh_id, now_s


def chat_completion_id() -> str:
    return f"chatcmpl-{fresh_id()}"


def completion_id() -> str:
    return f"cmpl-{fresh_id()}"


class ChatResponseMessage(ProtocolModel):
    """The assistant message of a finished chat choice."""

    role: Literal["assistant"] = Field(default="assistant", description="Always 'assistant'.")
    content: str | None = Field(default=None, description="The generated text.")


class ChatCompletionChoice(ProtocolModel):
    index: int = Field(default=0, description="Choice index.")
    message: ChatResponseMessage = Field(description="The generated message.")
    finish_reason: str | None = Field(default=None, description="stop, length, abort or error.")
    logprobs: Any = Field(default=None, description="Logprobs when requested, else null.")
    stop_reason: int | str | None = Field(
        default=None, description="Matched stop token id or string (vLLM extra).")


class ChatCompletionResponse(ProtocolModel):
    """A non-streamed chat completion."""

    id: str = Field(default_factory=chat_completion_id, description="'chatcmpl-...'.")
    object: Literal["chat.completion"] = Field(default="chat.completion", description="Object type.")
    created: int = Field(default_factory=now_s, description="Unix seconds.")
    model: str = Field(description="Served model name.")
    choices: list[ChatCompletionChoice] = Field(description="One choice.")
    usage: Usage = Field(default_factory=lambda: Usage(), description="Token counts.")


class DeltaMessage(ProtocolModel):
    """What a stream chunk adds to the message; unset fields are left out of the JSON."""

    role: Literal["assistant"] | None = Field(default=None, description="Sent on the first chunk only.")
    content: str | None = Field(default=None, description="New text.")

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(ProtocolModel):
    index: int = Field(default=0, description="Choice index.")
    delta: DeltaMessage = Field(default_factory=lambda: DeltaMessage(), description="New role and/or text.")
    finish_reason: str | None = Field(default=None, description="Set on the last content chunk.")
    logprobs: Any = Field(default=None, description="Logprobs of the new tokens when requested.")


class ChatCompletionChunk(ProtocolModel):
    """One SSE event of a streamed chat completion."""

    id: str = Field(description="Same id on every chunk of a stream.")
    object: Literal["chat.completion.chunk"] = Field(
        default="chat.completion.chunk", description="Object type.")
    created: int = Field(default_factory=now_s, description="Unix seconds.")
    model: str = Field(description="Served model name.")
    choices: list[ChatChunkChoice] = Field(default_factory=list, description="Empty in the usage event.")
    usage: Usage | None = Field(
        default=None, description="Set on the usage event (stream_options.include_usage).")


class CompletionChoice(ProtocolModel):
    index: int = Field(default=0, description="Prompt index (one choice per prompt).")
    text: str = Field(default="", description="Generated text (or the new text, in a chunk).")
    finish_reason: str | None = Field(default=None, description="stop, length, abort or error.")
    logprobs: Any = Field(default=None, description="Logprobs when requested, else null.")
    stop_reason: int | str | None = Field(
        default=None, description="Matched stop token id or string (vLLM extra).")


class CompletionResponse(ProtocolModel):
    """A non-streamed completion."""

    id: str = Field(default_factory=completion_id, description="'cmpl-...'.")
    object: Literal["text_completion"] = Field(default="text_completion", description="Object type.")
    created: int = Field(default_factory=now_s, description="Unix seconds.")
    model: str = Field(description="Served model name.")
    choices: list[CompletionChoice] = Field(description="One choice per prompt.")
    usage: Usage = Field(default_factory=lambda: Usage(), description="Token counts, summed over prompts.")


class CompletionChunk(ProtocolModel):
    """One SSE event of a streamed completion."""

    id: str = Field(description="Same id on every chunk of a stream.")
    object: Literal["text_completion"] = Field(default="text_completion", description="Object type.")
    created: int = Field(default_factory=now_s, description="Unix seconds.")
    model: str = Field(description="Served model name.")
    choices: list[CompletionChoice] = Field(default_factory=list, description="Empty in the usage event.")
    usage: Usage | None = Field(default=None, description="Set on the usage event.")


class ModelCard(ProtocolModel):
    id: str = Field(description="Served model name.")
    object: Literal["model"] = Field(default="model", description="Object type.")
    created: int = Field(default_factory=now_s, description="Unix seconds.")
    owned_by: str = Field(default="epd", description="Always 'epd'.")
    max_model_len: int | None = Field(default=None, description="Context length in tokens.")
    root: str | None = Field(default=None, description="Hub id or folder the model was loaded from.")


class ModelList(ProtocolModel):
    """GET /v1/models."""

    object: Literal["list"] = Field(default="list", description="Object type.")
    data: list[ModelCard] = Field(default_factory=list, description="Served models.")


class ErrorInfo(ProtocolModel):
    message: str = Field(description="What went wrong, for humans.")
    type: str = Field(description="Error class, e.g. invalid_request_error.")
    code: str | None = Field(default=None, description="Stable machine code, e.g. invalid_request.")
    param: str | None = Field(default=None, description="The offending parameter, when known.")


class ErrorResponse(ProtocolModel):
    """The body of every error answer, also sent in-stream as `data: {"error": ...}`."""

    error: ErrorInfo = Field(description="The error.")
