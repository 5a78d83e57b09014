"""Checks and scatter of multimodal items shared by every family's language model.

An item covers a run of image placeholder tokens [offset, offset + length) and
brings one embedding row per token.  Anything that does not fit the prompt is
the caller's error (`InvalidMultiModalInput`, a 400), never a crash inside the
forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from services.models.base import MultiModalInput
from services.models.loading import InvalidMultiModalInput

if TYPE_CHECKING:
    import torch


def checked_items(token_ids: Sequence[int], items: Sequence[MultiModalInput], image_token_id: int,
                  hidden_size: int, *, allow_touching: bool = True) -> list[MultiModalInput]:
    """`items` sorted by offset, after checking each against the prompt and all placeholders covered.

    `allow_touching=False` also refuses items that touch (M-RoPE groups consecutive image tokens
    into one image, so two touching items would be positioned as one).
    """
    ordered = sorted(items, key=lambda item: item.offset)
    end = -1
    for item in ordered:
        check_item(token_ids, item, image_token_id, hidden_size)
        if item.offset < end or (item.offset == end and not allow_touching):
            raise InvalidMultiModalInput(f"multimodal item at offset {item.offset} overlaps or touches "
                                         f"the previous one (ends at {end})")
        end = item.offset + item.length
    covered = sum(item.length for item in ordered)
    placeholders = sum(1 for token in token_ids if token == image_token_id)
    if placeholders != covered:
        raise InvalidMultiModalInput(
            f"prompt has {placeholders} image placeholder tokens but the items cover {covered}")
    return ordered


def check_item(token_ids: Sequence[int], item: MultiModalInput, image_token_id: int, hidden_size: int) -> None:
    where = f"{item.modality} item [{item.offset}, {item.offset + item.length})"
    if item.modality != "image":
        raise InvalidMultiModalInput(f"{where}: only image items are supported, not {item.modality!r}")
    if item.offset < 0 or item.length <= 0 or item.offset + item.length > len(token_ids):
        raise InvalidMultiModalInput(f"{where}: outside the prompt of {len(token_ids)} tokens")
    if any(token != image_token_id for token in token_ids[item.offset:item.offset + item.length]):
        raise InvalidMultiModalInput(f"{where}: range holds tokens other than the image token {image_token_id}")
    if item.embedding.dim() != 2 or tuple(item.embedding.shape) != (item.length, hidden_size):
        raise InvalidMultiModalInput(f"{where}: embedding shape {tuple(item.embedding.shape)} != "
                                     f"({item.length}, {hidden_size})")


def scatter(embeds: torch.Tensor, items: Sequence[MultiModalInput]) -> torch.Tensor:
    """Writes each item's embedding over its placeholder rows of `embeds` ([1, L, hidden]), in place."""
    for item in items:
        embeds[0, item.offset:item.offset + item.length] = item.embedding.to(embeds.device, embeds.dtype)
    return embeds
