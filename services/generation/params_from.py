"""Protocol sampling params (vLLM names, None = default) -> DecodeParams."""

from __future__ import annotations

from typing import Any

from services.generation.params import DecodeParams
from services.protocol.errors import InvalidRequest

_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stop", "stop_token_ids",
           "ignore_eos", "min_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty",
           "skip_special_tokens", "include_stop_str_in_output", "logprobs")


def decode_params(sampling: dict[str, Any]) -> DecodeParams:
    values = {k: sampling[k] for k in _FIELDS if sampling.get(k) is not None}
    try:
        return DecodeParams(**values)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"sampling_params: {exc}", code="invalid_sampling_params") from None
