"""Multimodal inputs of a GenerateRequest: rendered features, or raw content parts.

`MultiModalFeatures` is what render produces: per modality, one entry per
item in each of mm_hashes, mm_placeholders, kwargs_data (full processor output,
for encode) and mm_metadata (light fields, for prefill).  The checks that need
token_ids (placeholder bounds, metadata-only items needing ec_transfer_params)
live on GenerateRequest.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

from pydantic import (
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from services.protocol.common import ProtocolModel
from services.protocol.metadata_json import json_to_b64

ModalityLists = dict[str, list[str | None]]


class PlaceholderRange(ProtocolModel):
    """Where one item's embeddings go in token_ids: [offset, offset + length)."""

    offset: int = Field(ge=0, description="Index in token_ids of the item's first placeholder token.")
    length: int = Field(gt=0, description="Number of placeholder tokens (= number of embeddings).")
    is_embed: list[bool] | None = Field(
        default=None, description="epd extension (vLLM #54548, open): per placeholder token, whether it takes "
        "an embedding; left out of the JSON when null.  All true but for a Qwen3-VL video, whose range also "
        "holds each frame group's timestamp and markers.")

    @field_validator("is_embed")
    @classmethod
    def _mask(cls, value: list[bool] | None, info: ValidationInfo) -> list[bool] | None:
        length = info.data.get("length")
        if value is None:
            return value
        if length is not None and len(value) != length:
            raise ValueError(f"is_embed has {len(value)} entries for a placeholder of length {length}")
        if not any(value):
            raise ValueError("is_embed marks no placeholder token as an embedding")
        return value

    @model_serializer(mode="wrap")
    def _without_null_mask(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out = handler(self)
        if out.get("is_embed", ()) is None:
            del out["is_embed"]
        return out

    @property
    def end(self) -> int:
        return self.offset + self.length


class ContentPart(ProtocolModel):
    """Raw media the serving side fetches and processes itself."""

    type: Literal["image_url", "audio_url", "video_url"] = Field(description="Kind of media.")
    url: str = Field(min_length=1, description="http(s) URL, data: URL, or file path the server may read.")
    uuid: str | None = Field(default=None, min_length=1, max_length=1024,
                             description="The item's id: the same uuid is the same item; its mm_hash is derived "
                             "from (model, cache_salt, uuid), never the uuid as is (docs/security.md).")

    @property
    def modality(self) -> str:
        return self.type.removesuffix("_url")


class FeatureItem(NamedTuple):
    """One multimodal item of a request, as `MultiModalFeatures.items()` yields it."""

    modality: str
    index: int  # type: ignore[assignment]  # position within its modality's lists (shadows tuple.index)
    mm_hash: str
    placeholder: PlaceholderRange
    kwargs_b64: str | None
    metadata_b64: str | None


class MultiModalFeatures(ProtocolModel):
    """Rendered multimodal items, keyed by modality; all four maps share keys and list lengths."""

    mm_hashes: dict[str, list[str]] = Field(description="Content hash per item; the EC key.")
    mm_placeholders: dict[str, list[PlaceholderRange]] = Field(
        description="Placeholder range per item; non-overlapping across modalities.")
    kwargs_data: ModalityLists | None = Field(default=None, description="Base64 msgpack item per entry (full "
                                              "processor output); null entry = resolve by hash.")
    mm_metadata: ModalityLists | None = Field(
        default=None, description="Base64 msgpack item with only the light "
        "fields the embedding consumer still needs; or those fields as plain JSON number arrays "
        "({\"image_grid_thw\": [1, 4, 4]}, vLLM #56090), read as the same item.")

    @field_validator("mm_metadata", mode="before")
    @classmethod
    def _json_metadata(cls, value: Any) -> Any:
        """JSON-array entries (services.protocol.metadata_json) become the base64 items the roles read."""
        if not isinstance(value, dict):
            return value
        out: dict[str, Any] = {}
        for modality, entries in value.items():
            if not isinstance(entries, list):
                return value  # the type check reports it
            out[modality] = [_entry(modality, i, e) for i, e in enumerate(entries)]
        return out

    @model_validator(mode="after")
    def _check(self) -> MultiModalFeatures:
        self._check_same_shape()
        self._check_sorted_and_disjoint()
        return self

    def _check_same_shape(self) -> None:
        named: dict[str, dict[str, Any] | None] = {
            "mm_hashes": self.mm_hashes, "mm_placeholders": self.mm_placeholders,
            "kwargs_data": self.kwargs_data, "mm_metadata": self.mm_metadata}
        present = {name: value for name, value in named.items() if value is not None}
        keys = {name: sorted(value) for name, value in present.items()}
        if any(k != keys["mm_hashes"] for k in keys.values()):
            shown = ", ".join(f"{name} {k}" for name, k in keys.items())
            raise ValueError(f"modality keys differ: {shown}")
        for modality, hashes in self.mm_hashes.items():
            counts = {name: len(value[modality]) for name, value in present.items()}
            if len(set(counts.values())) > 1:
                shown = ", ".join(f"{name} {n}" for name, n in counts.items())
                raise ValueError(f"modality {modality!r} has list lengths that differ: {shown}")
            if any(not h for h in hashes):
                raise ValueError(f"mm_hashes.{modality}: hashes must be non-empty strings")

    def _check_sorted_and_disjoint(self) -> None:
        # Unsorted lists are fine (vLLM sorts before checking); ranges must not overlap.
        ordered = self.items()
        for before, after in zip(ordered, ordered[1:], strict=False):
            if after.placeholder.offset < before.placeholder.end:
                raise ValueError(
                    f"mm_placeholders: ranges overlap: {_name(before)} covers {_span(before)} and "
                    f"{_name(after)} covers {_span(after)}")

    def items(self) -> list[FeatureItem]:
        """Every item in prompt order (by placeholder offset)."""
        found = [self._item(modality, i) for modality, hashes in self.mm_hashes.items()
                 for i in range(len(hashes))]
        return sorted(found, key=lambda item: item.placeholder.offset)

    def _item(self, modality: str, index: int) -> FeatureItem:
        kwargs = self.kwargs_data[modality][index] if self.kwargs_data is not None else None
        metadata = self.mm_metadata[modality][index] if self.mm_metadata is not None else None
        return FeatureItem(modality, index, self.mm_hashes[modality][index],
                           self.mm_placeholders[modality][index], kwargs, metadata)

    @property
    def num_items(self) -> int:
        return sum(len(hashes) for hashes in self.mm_hashes.values())

    def has_metadata_only_items(self) -> bool:
        """True when some item has mm_metadata but no kwargs_data (it needs ec_transfer_params)."""
        return any(item.metadata_b64 is not None and item.kwargs_b64 is None for item in self.items())


def _entry(modality: str, index: int, entry: Any) -> Any:
    if not isinstance(entry, dict):
        return entry
    try:
        return json_to_b64(entry)
    except ValueError as exc:
        raise ValueError(f"mm_metadata.{modality}[{index}]: {exc}") from None


def _name(item: FeatureItem) -> str:
    return f"{item.modality}[{item.index}]"


def _span(item: FeatureItem) -> str:
    return f"[{item.placeholder.offset}, {item.placeholder.end})"
