"""Pieces every protocol model shares: the base model, ids, timestamps, Usage."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# A token id as it crosses gRPC (int32) and reaches an embedding table; strict so true/"5" are refused.
TokenId = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]
TransferParams = dict[str, Any]


class ProtocolModel(BaseModel):
    """Base of every wire model: NaN/inf refused, unknown fields ignored (callers add their own)."""

    model_config = ConfigDict(allow_inf_nan=False, extra="ignore", populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # Clients send `"temperature": null` for "use the default"; only fields defaulting to None keep null.
        if not isinstance(data, dict) or not any(v is None for v in data.values()):
            return data   # nothing to drop (`is`, not `in`: a value's own == may not give a bool)
        keep_null = _KEEP_NULL.get(cls)
        if keep_null is None:
            keep_null = _KEEP_NULL[cls] = frozenset(name for name, f in cls.model_fields.items()
                                                    if f.is_required() or f.default is None)
        return {k: v for k, v in data.items() if v is not None or k in keep_null}


_KEEP_NULL: dict[type, frozenset[str]] = {}   # per model class: the fields whose null is kept (built once)


def fresh_id() -> str:
    """A new request id (random, never derived from per-process state)."""
    return uuid.uuid4().hex


def now_s() -> int:
    """The `created` timestamp: whole seconds since the epoch."""
    return int(time.time())


class Usage(ProtocolModel):
    """Token counts of one request; total_tokens is filled in when absent."""

    prompt_tokens: int = Field(
        default=0, ge=0, description="Tokens in the prompt (after placeholder expansion).")
    completion_tokens: int = Field(default=0, ge=0, description="Tokens generated.")
    total_tokens: int = Field(default=0, ge=0, description="prompt_tokens + completion_tokens.")

    @model_validator(mode="before")
    @classmethod
    def _fill_total(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("total_tokens") is None:
            total = (data.get("prompt_tokens") or 0) + (data.get("completion_tokens") or 0)
            return {**data, "total_tokens": total} if isinstance(total, int) else data
        return data
