"""SamplingParams with vLLM's names, and the constrained types the OpenAI requests reuse.

The constraint types below are shared with openai.py, so a bad `temperature`
is refused at parse time with the caller's own field name, whichever endpoint
it came through.  max_tokens None means "server default" (the remaining
context), never 16.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field, field_validator, model_validator

from services.protocol.common import INT32_MAX, INT64_MAX, INT64_MIN, ProtocolModel, TokenId
from services.protocol.logprobs import MAX_LOGPROBS

MAX_N = 128   # samples per request; a decode instance further holds at most --decode-slots + --decode-queue


def _check_n(value: int) -> int:
    if not 1 <= value <= MAX_N:
        raise ValueError(f"must be between 1 and {MAX_N}, got {value}")
    return value


GREEDY_BELOW = 1e-5   # vLLM's _SAMPLING_EPS: a lower temperature is greedy


def check_greedy_n(n: int, temperature: float | None) -> None:
    """vLLM's rule and words: n greedy samples would all be the same sample."""
    if n > 1 and temperature is not None and temperature < GREEDY_BELOW:
        raise ValueError(f"n must be 1 when using greedy sampling, got {n}.")


def _check_top_k(value: int) -> int:
    if value < -1:
        raise ValueError("must be -1 or 0 (off) or a positive integer")
    return value


def _check_logprobs(value: int) -> int:
    if not 0 <= value <= MAX_LOGPROBS:  # vLLM: -1 means the whole vocabulary, which is more than max_logprobs
        raise ValueError(f"must be between 0 and {MAX_LOGPROBS} (max_logprobs), got {value}")
    return value


def _bool_as_one(value: Any) -> Any:
    return 1 if value is True else value   # vLLM: logprobs / prompt_logprobs True means 1


def _as_stop_list(value: Any) -> Any:
    if value is None:
        return []
    return [value] if isinstance(value, str) else value


def _check_stop(value: list[str]) -> list[str]:
    if any(s == "" for s in value):
        raise ValueError("must not contain an empty string")
    return value


MaxTokens = Annotated[int, Field(ge=1, le=INT32_MAX)]
Temperature = Annotated[float, Field(ge=0)]
TopP = Annotated[float, Field(gt=0, le=1)]
TopK = Annotated[int, Field(le=INT32_MAX), AfterValidator(_check_top_k)]
MinP = Annotated[float, Field(ge=0, le=1)]
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
StopStrings = Annotated[list[str], BeforeValidator(_as_stop_list), AfterValidator(_check_stop)]
StopTokenIds = list[TokenId]
MinTokens = Annotated[int, Field(ge=0, le=INT32_MAX)]
Logprobs = Annotated[int, BeforeValidator(_bool_as_one), AfterValidator(_check_logprobs)]
RepetitionPenalty = Annotated[float, Field(gt=0)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
NumChoices = Annotated[int, AfterValidator(_check_n)]


class SamplingParams(ProtocolModel):
    """How to sample, in vLLM SamplingParams names; null = default (ProtocolModel)."""

    max_tokens: MaxTokens | None = Field(
        default=None, description="Tokens to generate; null = server default "
        "(the remaining context).")
    temperature: Temperature = Field(default=1.0, description="Softmax temperature; 0 = greedy.")
    top_p: TopP = Field(default=1.0, description="Nucleus sampling mass, 0 < top_p <= 1.")
    top_k: TopK = Field(default=0, description="Keep the k most likely tokens; 0 or -1 = off.")
    min_p: MinP = Field(default=0.0, description="Drop tokens below min_p times the top probability.")
    seed: Seed | None = Field(default=None, description="Per-request sampling seed.")
    stop: StopStrings = Field(default_factory=list, description="Stop strings (a string or a list).")
    stop_token_ids: StopTokenIds = Field(default_factory=list, description="Token ids that stop generation.")
    ignore_eos: bool = Field(default=False, description="Keep generating past the EOS token.")
    min_tokens: MinTokens = Field(default=0, description="Tokens to generate before EOS or stops may end it.")
    logprobs: Logprobs | None = Field(default=None, description="Top logprobs per output token, 0..20.")
    prompt_logprobs: Logprobs | None = Field(default=None, description="Top logprobs per prompt token, 0..20 "
                                             "(computed by prefill; the first prompt token has none).")
    repetition_penalty: RepetitionPenalty = Field(
        default=1.0, description="Penalty (> 0) on repeated tokens.")
    presence_penalty: Penalty = Field(default=0.0, description="-2..2 penalty on tokens already present.")
    frequency_penalty: Penalty = Field(default=0.0, description="-2..2 penalty scaled by token frequency.")
    n: NumChoices = Field(default=1, description=f"Samples of the prompt (1..{MAX_N}): one render, encode and "
                          "prefill; decode forks them from the prompt's KV (sample i of a seeded request draws "
                          "with seed + i).")
    extra_args: dict[str, Any] | None = Field(
        default=None, description="Free-form extras (older callers nest "
        "kv_transfer_params / ec_transfer_params here).")
    skip_special_tokens: bool = Field(default=True, description="Drop special tokens from the output text.")
    include_stop_str_in_output: bool = Field(
        default=False, description="Keep the matched stop string in the text.")
    # vLLM's render always writes these; epd carries them so a render answer round-trips unchanged.
    detokenize: bool = Field(default=True, description="vLLM: detokenize the output (output_mode 'text' needs it).")
    output_kind: int = Field(default=0, ge=0, le=2, description="vLLM RequestOutputKind: 0 cumulative, 1 delta, "
                             "2 final only (render: 1 when streaming, else 2); epd streams deltas either way.")
    skip_clone: bool = Field(default=False, description="vLLM-internal; carried.")
    bad_words: list[str] = Field(default_factory=list, description="Not supported: must be empty.")
    skip_reading_prefix_cache: bool | None = Field(default=None, description="vLLM: bypass prefix-cache reads; "
                                                   "only false/null are supported.")

    @field_validator("bad_words")
    @classmethod
    def _no_bad_words(cls, value: list[str]) -> list[str]:
        if value:
            raise ValueError("bad_words is not supported")
        return value

    @field_validator("skip_reading_prefix_cache")
    @classmethod
    def _reads_prefix_cache(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("true is not supported (epd's prefix cache is always read)")
        return value

    @model_validator(mode="after")
    def _min_within_max(self) -> SamplingParams:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        check_greedy_n(self.n, self.temperature)
        return self

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
