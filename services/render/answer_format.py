"""Render answers in the forms a caller asks for (epd extensions beside vLLM's render request fields).

- `"mm_metadata_format": "json"`: each `features.mm_metadata` entry as plain JSON number arrays
  (`{"image_grid_thw": [1, 4, 4]}`, vLLM #56090's idea; services.protocol.metadata_json) instead of
  base64 msgpack, so a router without msgpack or torch can read the grid; default "base64" (vLLM's).
- `"return_is_embed": true`: each placeholder with `is_embed`, one flag per placeholder token (false on a
  Qwen3-VL video's timestamp text and markers)
  (vLLM #54548, still open).  Every placeholder token epd's families write takes an embedding, so
  the mask is all true; generate accepts it (and refuses sparse masks, which no epd family makes).

Both are off by default, so render's answer stays byte-compatible with vLLM's.  vLLM's own
`mm_payload` ("tensors" | "none", and its deprecated alias `return_mm_kwargs: false`) is honoured too:
"none" leaves kwargs_data and mm_metadata null and serializes no pixels at all (the roles' OpenAI-format
decode calls ask for it: they need only the token ids); epd's extra value "metadata" keeps mm_metadata
and the request's ec_transfer_params, the view a prefill takes (their prefill calls ask for it).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Literal

from pydantic import Field

from services.protocol.common import TransferParams
from services.protocol.errors import InvalidRequest
from services.protocol.generate import GenerateRequest
from services.protocol.metadata_json import b64_to_json
from services.protocol.openai import ChatCompletionRequest


class RenderChatRequest(ChatCompletionRequest):
    """A chat render request: vLLM's fields plus epd's answer-format options."""

    mm_payload: Literal["tensors", "none", "metadata"] = Field(
        default="tensors", description="vLLM's: 'none' answers kwargs_data and mm_metadata null (token layout and "
        "hashes only, for cache-aware routers; not for /inference/v1/generate). epd's 'metadata': kwargs_data "
        "null, mm_metadata kept, with the request's ec_transfer_params (a prefill's view: no pixels).")
    ec_transfer_params: TransferParams | None = Field(
        default=None, description="vLLM's chat field; with mm_payload 'metadata' the answer carries it.")
    return_mm_kwargs: bool | None = Field(default=None, description="vLLM's deprecated alias: false = "
                                          "mm_payload 'none'; ignored when mm_payload is set.")
    mm_metadata_format: Literal["base64", "json"] = Field(
        default="base64", description="epd extension: 'json' answers mm_metadata as plain number arrays.")
    return_is_embed: bool = Field(default=False, description="epd extension: placeholders carry is_embed.")

    @property
    def payload(self) -> str:
        """The effective mm_payload (vLLM's rule: return_mm_kwargs false is 'none' unless mm_payload is set)."""
        if "mm_payload" not in self.model_fields_set and self.return_mm_kwargs is False:
            return "none"
        return self.mm_payload

    def answer_kwargs(self, has_items: bool) -> dict[str, Any]:
        """`RenderedPrompt.to_generate_request`'s arguments for this request's payload."""
        payload = self.payload
        if payload == "metadata" and has_items and not self.ec_transfer_params:
            raise InvalidRequest("mm_payload 'metadata' needs ec_transfer_params (the EC handles of the images): "
                                 "a metadata-only answer is what a prefill takes", code="missing_ec_transfer_params")
        return {"include_kwargs": payload == "tensors", "include_metadata": payload != "none",
                "ec_transfer_params": self.ec_transfer_params if payload == "metadata" and has_items else None}

    @property
    def plain_answer(self) -> bool:
        return self.mm_metadata_format == "base64" and not self.return_is_embed


def formatted(generate: GenerateRequest, request: RenderChatRequest, pads: Collection[int] = ()) -> dict[str, Any]:
    """The render answer as JSON, with mm_metadata and placeholders in the forms `request` asked for; `pads`: the
    placeholder tokens that take an embedding (a Qwen3-VL video's range also holds its timestamps)."""
    body = generate.model_dump(mode="json")
    features = body.get("features")
    if not features:
        return body
    if request.mm_metadata_format == "json" and features.get("mm_metadata"):
        features["mm_metadata"] = {modality: [None if e is None else b64_to_json(e) for e in entries]
                                   for modality, entries in features["mm_metadata"].items()}
    if request.return_is_embed:
        ids, wanted = body["token_ids"], set(pads)
        for ranges in features["mm_placeholders"].values():
            for place in ranges:
                span = ids[place["offset"]:place["offset"] + place["length"]]
                place["is_embed"] = [token in wanted for token in span] if wanted else [True] * place["length"]
    return body
