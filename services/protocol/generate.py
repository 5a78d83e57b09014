"""POST /inference/v1/generate and POST /abort_requests: requests, responses, stream chunks.

Every role and the coordinator speak these.  A render answer posts here
unchanged.  Older callers nest kv_transfer_params / ec_transfer_params in
sampling_params.extra_args; after validation they are lifted to the top level
(the top-level value wins), so `.kv_transfer_params` / `.ec_transfer_params`
are always the effective ones and extra_args no longer carries them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from services.protocol.common import ProtocolModel, TokenId, TransferParams, Usage, fresh_id, now_s
from services.protocol.features import ContentPart, FeatureItem, MultiModalFeatures
from services.protocol.sampling import SamplingParams

RESPONSE_ID_PREFIX = "generate-tokens-"
MAX_CACHE_SALT_CHARS = 128  # vLLM's validate_cache_salt (its GenerateRequest field also says 1024; 128 wins)
_SALT_FORBIDDEN = ("@", "/", "\\", "\0")
FinishReason = Literal["stop", "length", "abort", "error"]
OutputMode = Literal["tokens", "text"]


def _check_cache_salt(value: str) -> str:
    """vLLM's rules: non-empty, at most 128 characters, none of '@', '/', '\\', NUL (they delimit cache keys)."""
    if not value:
        raise ValueError("must be a non-empty string")
    if len(value) > MAX_CACHE_SALT_CHARS or any(c in value for c in _SALT_FORBIDDEN):
        raise ValueError(f"must be at most {MAX_CACHE_SALT_CHARS} characters and must not contain "
                         "'@', '/', '\\', or NUL")
    return value


CacheSalt = Annotated[str, AfterValidator(_check_cache_salt)]
_TRANSFER_KEYS = ("kv_transfer_params", "ec_transfer_params")


class StreamOptions(ProtocolModel):
    """What a streamed answer reports besides tokens (OpenAI / vLLM semantics)."""

    include_usage: bool = Field(default=True, description="Send a last event with empty choices and usage.")
    continuous_usage_stats: bool = Field(default=False, description="Attach usage to every event.")


class GenerateRequest(ProtocolModel):
    """Tokens plus multimodal features (or raw content parts) plus sampling: one generation."""

    request_id: str = Field(default_factory=fresh_id, min_length=1, description="Caller's id; default fresh.")
    token_ids: list[TokenId] = Field(description="Prompt token ids, placeholder-expanded (one token per "
                                     "embedding); at least one.")
    features: MultiModalFeatures | None = Field(default=None, description="Rendered multimodal items.")
    content_parts: list[ContentPart] | None = Field(
        default=None, description="Raw media to fetch server-side; "
        "mutually exclusive with features.")
    sampling_params: SamplingParams = Field(default_factory=lambda: SamplingParams(),
                                            description="vLLM sampling; null = defaults.")
    model: str | None = Field(default=None, description="Model name; null passes the model check.")
    stream: bool = Field(default=False, description="Answer as server-sent events.")
    stream_options: StreamOptions | None = Field(default=None, description="Usage reporting when streaming.")
    cache_salt: CacheSalt | None = Field(default=None, description="Non-empty, <= 128 chars, no '@' '/' '\\' NUL "
                                         "(vLLM's rules); part of every prefix-cache key.")
    priority: int = Field(default=0, description="Scheduling priority (lower runs first, as in vLLM).")
    kv_transfer_params: TransferParams | None = Field(default=None, description="KV connector handle (decode "
                                                      "input, prefill output).")
    ec_transfer_params: TransferParams | None = Field(default=None, description="{mm_hash: handle} of stored "
                                                      "embeddings (prefill input, encode output).")
    return_token_ids: bool | None = Field(default=None, description="Answer with prompt_token_ids and "
                                          "mm_placeholders (streaming: on the first chunk).")
    output_mode: OutputMode = Field(default="tokens", description="'tokens': ids only; 'text': also the "
                                    "detokenized text and logprobs with token strings (needs "
                                    "sampling_params.detokenize).")
    token_offsets: list[tuple[int, int]] | None = Field(default=None, description="vLLM: char offsets per token "
                                                        "(render of plain text); carried, not used.")
    reasoning_ended: bool | None = Field(default=None, description="vLLM render's reasoning state; carried.")
    reasoning_parser_kwargs: dict[str, Any] | None = Field(default=None, description="vLLM render's parser "
                                                           "kwargs; carried.")

    @field_validator("token_ids")
    @classmethod
    def _not_empty(cls, value: list[int]) -> list[int]:
        if not value:
            raise ValueError("must not be empty")
        return value

    @model_validator(mode="after")
    def _normalize_and_check(self) -> GenerateRequest:
        self._lift_transfer_params()
        self._check_multimodal()
        return self

    def _lift_transfer_params(self) -> None:
        extra = self.sampling_params.extra_args
        if not extra or not any(key in extra for key in _TRANSFER_KEYS):
            return
        for key in _TRANSFER_KEYS:
            nested = extra.get(key)
            if nested is not None and not isinstance(nested, dict):
                raise ValueError(f"sampling_params.extra_args.{key}: must be an object")
            if getattr(self, key) is None and nested is not None:
                setattr(self, key, nested)
        rest = {k: v for k, v in extra.items() if k not in _TRANSFER_KEYS}
        self.sampling_params = self.sampling_params.model_copy(update={"extra_args": rest or None})

    def _check_multimodal(self) -> None:
        if self.output_mode != "tokens" and not self.sampling_params.detokenize:  # vLLM's check and message
            raise ValueError(f"output_mode={self.output_mode!r} requires sampling_params.detokenize to be true")
        if self.content_parts and self.features is not None:
            raise ValueError("content_parts and features are mutually exclusive")
        for item in self.items():
            if item.placeholder.end > len(self.token_ids):
                raise ValueError(
                    f"features.mm_placeholders.{item.modality}[{item.index}]: offset+length "
                    f"({item.placeholder.end}) exceeds len(token_ids) ({len(self.token_ids)})")
        if self.features is not None and self.features.has_metadata_only_items() \
                and not self.ec_transfer_params:
            raise ValueError("metadata-only multimodal items require ec_transfer_params")

    def items(self) -> list[FeatureItem]:
        """Every rendered multimodal item in prompt order; empty without features."""
        return self.features.items() if self.features is not None else []


class GenerateChoice(ProtocolModel):
    """Generated tokens of one choice; in a stream chunk, the delta since the last event."""

    index: int = Field(default=0, description="Choice index: the sample (0..n-1).")
    token_ids: list[int] = Field(default_factory=list, description="Generated token ids (or the delta).")
    finish_reason: FinishReason | None = Field(
        default=None, description="Why generation ended; null while running.")
    logprobs: Any = Field(default=None, description="Logprobs when requested, else null.")
    stop_reason: int | str | None = Field(
        default=None, description="Matched stop token id or string, if any.")
    weight_versions: list[dict[str, Any]] | None = Field(
        default=None, description="vLLM's spans [{version, start, end}] over the output token indexes: the weights "
        "that sampled them (a streamed choice: on its final chunk only).")


class GenerateResponse(ProtocolModel):
    """The non-streamed answer of /inference/v1/generate."""

    request_id: str = Field(description="'generate-tokens-<id>', see response_id().")
    model: str | None = Field(default=None, description="Served model name.")
    created: int = Field(default_factory=now_s, description="Unix seconds.")
    choices: list[GenerateChoice] = Field(default_factory=list, description="One choice per sample.")
    usage: Usage = Field(default_factory=lambda: Usage(), description="Token counts (all samples).")
    kv_transfer_params: TransferParams | None = Field(
        default=None, description="From prefill: what decode carries.")
    ec_transfer_params: TransferParams | None = Field(
        default=None, description="From encode: {mm_hash: handle}.")
    output_mode: OutputMode = Field(default="tokens", description="vLLM's discriminator: 'tokens' here.")
    prompt_token_ids: list[int] | None = Field(default=None, description="With return_token_ids (vLLM).")
    mm_placeholders: dict[str, Any] | None = Field(default=None, description="With return_token_ids (vLLM).")
    metrics: dict[str, Any] | None = Field(default=None, description="Per-request metrics, when asked (vLLM).")
    prompt_logprobs: list[dict[str, Any] | None] | None = Field(
        default=None, description="With sampling_params.prompt_logprobs (vLLM): per prompt token (null for the "
        "first) {token id: {logprob, rank, decoded_token}}, the prompt's token first, then the top n.")


class GenerateStreamChunk(ProtocolModel):
    """One SSE event of a streamed generate; carries no transfer params (never stream a prefill)."""

    request_id: str = Field(description="Same id as the non-streamed response would carry.")
    model: str | None = Field(default=None, description="Served model name.")
    created: int = Field(default_factory=now_s, description="Unix seconds.")
    choices: list[GenerateChoice] = Field(default_factory=list, description="Token deltas; empty in the "
                                          "final usage-only event.")
    usage: Usage | None = Field(default=None, description="Set on the usage event (or every event when "
                                "continuous_usage_stats).")
    output_mode: OutputMode = Field(default="tokens", description="vLLM's discriminator: 'tokens' here.")


class GenerateTextChoice(GenerateChoice):
    """output_mode 'text' (vLLM's GenerateTextChoice): the ids plus their text; logprobs in OpenAI's chat shape."""

    text: str = Field(description="Detokenized output (a stream chunk: the delta since the last event); a "
                      "matched stop string excluded unless include_stop_str_in_output; token_ids keep every "
                      "generated token.")


class GenerateTextResponse(GenerateResponse):
    """The non-streamed answer of an output_mode 'text' generate (vLLM's GenerateTextResponse)."""

    choices: list[GenerateTextChoice] = Field(  # type: ignore[assignment]
        default_factory=list, description="One choice.")
    output_mode: Literal["text"] = Field(  # type: ignore[assignment]
        default="text", description="vLLM's discriminator.")


class GenerateTextStreamChunk(GenerateStreamChunk):
    """One SSE event of an output_mode 'text' generate (vLLM's GenerateTextStreamResponse)."""

    choices: list[GenerateTextChoice] = Field(  # type: ignore[assignment]
        default_factory=list, description="Deltas; empty in the final usage-only event.")
    output_mode: Literal["text"] = Field(  # type: ignore[assignment]
        default="text", description="vLLM's discriminator.")


class AbortRequest(ProtocolModel):
    """POST /abort_requests body."""

    request_ids: list[str] = Field(description="Ids of the requests to abort; unknown ids are ignored.")


def response_id(request_id: str, x_request_id: str | None = None) -> str:
    """'generate-tokens-<id>' where <id> is the X-Request-Id header when given, else request_id."""
    chosen = x_request_id or request_id
    return chosen if chosen.startswith(RESPONSE_ID_PREFIX) else RESPONSE_ID_PREFIX + chosen
