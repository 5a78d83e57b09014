"""OpenAI request bodies: /v1/chat/completions and /v1/completions (and their /render forms).

Sampling fields reuse the constrained types of sampling.py, so a bad value is
refused at parse time under the caller's own field name; `to_sampling_params()`
then maps to vLLM names.  Unknown fields are ignored, as OpenAI clients send
many.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from services.protocol.common import ProtocolModel, TokenId, TransferParams
from services.protocol.generate import CacheSalt, StreamOptions
from services.protocol.parsing import validate_model
from services.protocol.sampling import (
    Logprobs,
    MaxTokens,
    MinP,
    MinTokens,
    NumChoices,
    Penalty,
    RepetitionPenalty,
    SamplingParams,
    Seed,
    StopStrings,
    StopTokenIds,
    Temperature,
    TopK,
    TopP,
    check_greedy_n,
)

Role = Literal["system", "user", "assistant", "tool"]
_SAMPLING_NAMES = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
                   "min_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty", "n",
                   "skip_special_tokens", "include_stop_str_in_output", "prompt_logprobs")


MAX_UUID_CHARS = 1024


class ImageURL(ProtocolModel):
    """The image_url object of a content part."""

    url: str = Field(min_length=1, description="http(s) URL or data: URL of the image.")
    detail: str | None = Field(default=None, description="OpenAI detail hint (auto/low/high); ignored.")
    uuid: str | None = Field(default=None, min_length=1, max_length=MAX_UUID_CHARS,
                             description="The item's id, as on the part itself (the part's own uuid wins).")


class VideoURL(ProtocolModel):
    """The video_url object of a content part (vLLM's shape)."""

    url: str = Field(min_length=1, description="http(s) URL or data: URL (video/mp4, video/webm, ...) of the video.")
    uuid: str | None = Field(default=None, min_length=1, max_length=MAX_UUID_CHARS,
                             description="The item's id, as on the part itself (the part's own uuid wins).")


class ChatContentPart(ProtocolModel):
    """One part of a message's content: text, an image or a video."""

    type: Literal["text", "image_url", "video_url"] = Field(description="Part kind.")
    text: str | None = Field(default=None, description="The text, for type 'text'.")
    image_url: ImageURL | None = Field(
        default=None, description="The image, for type 'image_url' (a bare URL "
        "string is accepted too).")
    video_url: VideoURL | None = Field(
        default=None, description="The video, for type 'video_url' (a bare URL string is accepted too).")
    uuid: str | None = Field(
        default=None, min_length=1, max_length=MAX_UUID_CHARS,
        description="vLLM's item id: the same uuid is the same item, so its embedding is reused; scoped by model "
        "and cache_salt (another salt is another tenant), never a global key (docs/security.md).")

    @field_validator("image_url", "video_url", mode="before")
    @classmethod
    def _bare_url(cls, value: Any) -> Any:
        return {"url": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _payload_matches_type(self) -> ChatContentPart:
        if self.type == "text" and self.text is None:
            raise ValueError("a 'text' part needs text")
        if self.type == "image_url" and self.image_url is None:
            raise ValueError("an 'image_url' part needs image_url")
        if self.type == "video_url" and self.video_url is None:
            raise ValueError("a 'video_url' part needs video_url")
        return self


class ChatMessage(ProtocolModel):
    """One chat message; content is a string or a list of parts."""

    role: Role = Field(description="Author of the message.")
    content: str | list[ChatContentPart] | None = Field(
        default=None, description="Text, or text, image and video parts.")
    name: str | None = Field(default=None, description="Optional author name.")
    tool_call_id: str | None = Field(default=None, description="For role 'tool': the call answered.")
    tool_calls: list[dict[str, Any]] | None = Field(
        default=None, description="For role 'assistant': calls made.")

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and self.role in ("system", "user"):
            raise ValueError(f"content is required for role {self.role!r}")
        return self

    def image_urls(self) -> list[str]:
        parts = self.content if isinstance(self.content, list) else []
        return [p.image_url.url for p in parts if p.type == "image_url" and p.image_url is not None]


class _OpenAISampling(ProtocolModel):
    """Fields shared by chat and completion requests."""

    model: str | None = Field(default=None, description="Model name; null passes the model check.")
    max_tokens: MaxTokens | None = Field(
        default=None, description="Tokens to generate; null = server default.")
    temperature: Temperature | None = Field(default=None, description="Softmax temperature.")
    top_p: TopP | None = Field(default=None, description="Nucleus sampling mass.")
    top_k: TopK | None = Field(default=None, description="Top-k; 0 or -1 = off.")
    min_p: MinP | None = Field(default=None, description="Minimum relative probability.")
    seed: Seed | None = Field(default=None, description="Sampling seed.")
    stop: StopStrings | None = Field(default=None, description="Stop string or strings.")
    stop_token_ids: StopTokenIds | None = Field(default=None, description="Token ids that stop generation.")
    n: NumChoices = Field(default=1, description="Choices: samples of one prompt (one render, encode and prefill).")
    best_of: int | None = Field(default=None, ge=1, description="vLLM 0.32 has no best_of (its SamplingParams "
                                "dropped it): only null or n is accepted.")
    prompt_logprobs: Logprobs | None = Field(default=None, description="vLLM: top logprobs per prompt token "
                                             "(0..20), answered as prompt_logprobs; not with stream.")
    return_tokens_as_token_ids: bool | None = Field(default=None, description="vLLM: logprobs name tokens "
                                                    "'token_id:<id>' (null: the server's "
                                                    "--return-tokens-as-token-ids).")
    presence_penalty: Penalty | None = Field(default=None, description="-2..2.")
    frequency_penalty: Penalty | None = Field(default=None, description="-2..2.")
    repetition_penalty: RepetitionPenalty | None = Field(default=None, description="> 0.")
    ignore_eos: bool | None = Field(default=None, description="Generate past EOS.")
    min_tokens: MinTokens | None = Field(default=None, description="Minimum tokens before stopping.")
    skip_special_tokens: bool | None = Field(default=None, description="Drop special tokens from text.")
    include_stop_str_in_output: bool | None = Field(default=None, description="Keep the stop string.")
    stream: bool = Field(default=False, description="Answer as server-sent events.")
    stream_options: StreamOptions | None = Field(default=None, description="Usage reporting when streaming.")
    user: str | None = Field(default=None, description="End-user id (logged, not used).")
    cache_salt: CacheSalt | None = Field(default=None, description="Prefix-cache salt (vLLM's rules: non-empty, "
                                         "<= 128 chars, no '@' '/' '\\' NUL).")
    request_id: str | None = Field(default=None, min_length=1, description="vLLM: the id render answers with "
                                   "('chatcmpl-<id>'); the X-Request-Id header wins.")
    priority: int = Field(default=0, description="Scheduling priority.")
    kv_transfer_params: TransferParams | None = Field(default=None, description="KV connector handle (P/D).")

    @model_validator(mode="after")
    def _min_within_max(self) -> _OpenAISampling:
        limit = self._max_tokens()
        if limit is not None and self.min_tokens is not None and self.min_tokens > limit:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({limit})")
        check_greedy_n(self.n, self.temperature)
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of ({self.best_of}) must be null or equal to n ({self.n}): vLLM 0.32 dropped "
                             "best_of; ask for n samples and rank them yourself")
        if self.prompt_logprobs is not None and self.stream:   # vLLM's rule and message
            raise ValueError("prompt_logprobs: `prompt_logprobs` are not available when `stream=True`.")
        return self

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def _sampling_kwargs(self) -> dict[str, Any]:
        values = {name: getattr(self, name) for name in _SAMPLING_NAMES}
        return {name: value for name, value in values.items() if value is not None}


class ChatCompletionRequest(_OpenAISampling):
    """An OpenAI chat completion request."""

    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    max_completion_tokens: MaxTokens | None = Field(
        default=None, description="Newer name of max_tokens; wins.")
    logprobs: bool = Field(default=False, description="Return logprobs of the generated tokens.")
    top_logprobs: int | None = Field(default=None, ge=0, le=20, description="Alternatives per token.")
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="Extra chat template variables.")
    add_generation_prompt: bool = Field(default=True, description="End the prompt with the assistant header.")
    continue_final_message: bool = Field(default=False, description="Continue the last (assistant) message.")

    @field_validator("logprobs", mode="before")
    @classmethod
    def _null_logprobs(cls, value: Any) -> Any:
        return False if value is None else value

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:  # vLLM's rule (0 is allowed without)
            raise ValueError("top_logprobs: when using top_logprobs, logprobs must be set to true")
        return self

    def to_sampling_params(self) -> SamplingParams:
        """The vLLM SamplingParams of this request (max_tokens None = server default)."""
        kwargs = self._sampling_kwargs()
        kwargs["max_tokens"] = self._max_tokens()
        kwargs["logprobs"] = (self.top_logprobs or 0) if self.logprobs else None
        return validate_model(SamplingParams, kwargs)

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def image_urls(self) -> list[str]:
        """Every image URL in message order."""
        return [url for message in self.messages for url in message.image_urls()]


PromptInput = str | list[str] | list[list[TokenId]] | list[TokenId]


def _check_prompt(value: Any) -> Any:
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise ValueError("must be a string, a list of strings, a list of token ids or a list of lists "
                         "of token ids, and not empty")
    kinds = {type(v) for v in value}
    if kinds not in ({str}, {int}, {list}):
        raise ValueError("must not mix strings, token ids and token id lists")
    if list in kinds and any(not p for p in value):
        raise ValueError("token id lists must not be empty")
    return value


class CompletionRequest(_OpenAISampling):
    """An OpenAI (legacy) completion request; each prompt becomes one generation."""

    prompt: PromptInput = Field(description="A string, strings, token ids, or lists of token ids.")
    logprobs: int | None = Field(default=None, ge=0, le=20, description="Top logprobs per generated token.")
    echo: bool = Field(default=False, description="Prepend the prompt to the output text.")
    suffix: str | None = Field(default=None, description="Not supported; must be null.")

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        return _check_prompt(value)

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one entry per generation: a string or a list of token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]  # type: ignore[arg-type]
        return list(self.prompt)  # type: ignore[arg-type]

    def to_sampling_params(self) -> SamplingParams:
        """The vLLM SamplingParams of this request (max_tokens None = server default)."""
        kwargs = self._sampling_kwargs()
        kwargs["max_tokens"] = self.max_tokens
        kwargs["logprobs"] = self.logprobs
        return validate_model(SamplingParams, kwargs)
