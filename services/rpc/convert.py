"""The only place that knows both the JSON protocol and the protobuf messages."""

from __future__ import annotations

import json
from typing import Any

from services.rpc.v1 import epd_pb2 as pb

_OPTIONAL = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
             "presence_penalty", "frequency_penalty", "logprobs", "n", "prompt_logprobs")
_PLAIN = ("ignore_eos", "min_tokens", "skip_special_tokens", "include_stop_str_in_output")


def sampling_to_pb(params: dict[str, Any]) -> pb.SamplingParams:
    """vLLM-named sampling dict -> proto; None values stay unset (server defaults apply)."""
    msg = pb.SamplingParams()
    for name in _OPTIONAL:
        if params.get(name) is not None:
            setattr(msg, name, params[name])
    for name in _PLAIN:
        if params.get(name) is not None:
            setattr(msg, name, params[name])
    if params.get("skip_special_tokens") is None:
        msg.skip_special_tokens = True  # vLLM's default
    stop = params.get("stop")
    msg.stop.extend([stop] if isinstance(stop, str) else (stop or []))
    msg.stop_token_ids.extend(params.get("stop_token_ids") or [])
    return msg


def sampling_from_pb(msg: pb.SamplingParams) -> dict[str, Any]:
    out: dict[str, Any] = {name: getattr(msg, name) if msg.HasField(name) else None for name in _OPTIONAL}
    out.update({name: getattr(msg, name) for name in _PLAIN})
    out["stop"] = list(msg.stop)
    out["stop_token_ids"] = list(msg.stop_token_ids)
    return out


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def loads(raw: bytes) -> Any:
    return json.loads(raw) if raw else None


def metadata_only(item: pb.MultiModalItem) -> pb.MultiModalItem:
    """The item as prefill receives it: placement and mm_metadata, never kwargs_data."""
    return pb.MultiModalItem(modality=item.modality, mm_hash=item.mm_hash, offset=item.offset,
                             length=item.length, mm_metadata=item.mm_metadata)
