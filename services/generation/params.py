"""Sampling and stopping parameters of one decode request.

`DecodeParams` is what the decode engine (and prefill's `sample_first_logprobs`) take;
the servicer maps protocol SamplingParams (vLLM names) onto it.  Defaults
follow vLLM: temperature 1.0, no top-k/top-p/min-p, no penalties, special
tokens skipped in text.  `max_tokens=None` means "the rest of the context".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from services.protocol.errors import InvalidRequest
from services.protocol.logprobs import MAX_LOGPROBS

# Below this a temperature means greedy (as in vLLM).
SAMPLING_EPS = 1e-5


@dataclass(frozen=True)
class DecodeParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None       # None: up to max_model_len
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logprobs: int | None = None         # top logprobs per output token (0..20); None: none computed

    def __post_init__(self) -> None:
        # Accept lists from callers; store tuples so params stay hashable-ish and immutable.
        object.__setattr__(self, "stop", _as_tuple(self.stop, str, "stop"))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, int, "stop_token_ids"))
        self._validate()

    def _validate(self) -> None:
        _check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= -1, f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        _check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        _check(self.max_tokens is None or self.max_tokens >= 1,
               f"max_tokens must be >= 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
               f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        _check(self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check(-2 <= self.presence_penalty <= 2,
               f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        _check(-2 <= self.frequency_penalty <= 2,
               f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        _check(all(self.stop), "stop strings must be non-empty")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be >= 0")
        _check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
               f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that needs every logit of its first token (logprobs, penalties, min_tokens):
        the LM head screen may pick it (services/models/head_screen.py)."""
        return self.is_greedy and self.logprobs is None and not self.has_penalties and not self.min_tokens

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def uses_top_k(self) -> bool:
        return self.top_k > 0


def sample_params(params: DecodeParams, index: int) -> DecodeParams:
    """The params of sample `index` of a request for n samples: its own seed, seed + index (vLLM's rule), when
    the request is seeded (services/decode/samples.py)."""
    if params.seed is None or index == 0:
        return params
    return dataclasses.replace(params, seed=params.seed + index)


def _as_tuple(values: Any, kind: type, name: str) -> tuple:
    if values is None:
        return ()
    if isinstance(values, kind):   # a single stop string or id
        return (values,)
    items = tuple(values)
    _check(all(isinstance(v, kind) and not isinstance(v, bool) for v in items),
           f"{name} must be a list of {kind.__name__}")
    return items


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequest(message)
