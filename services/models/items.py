"""Checks and scatter of multimodal items shared by every family's language model.

An item covers a range [offset, offset + length) of the prompt and brings one embedding row per
placeholder token of its modality (`pad_ids`: image and video pads).  A *dense* item's range holds only
placeholders (images; Qwen2-VL and Qwen2.5-VL videos); a *sparse* one's (a Qwen3-VL video: each frame
group's pads between its timestamp text and markers) holds other tokens too, and its embedding rows go
to its placeholders in order.  Anything that does not fit the prompt is the caller's error
(`InvalidMultiModalInput`, a 400), never a crash inside the forward.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING

from services.models.base import MultiModalInput
from services.models.loading import InvalidMultiModalInput

if TYPE_CHECKING:
    import torch


def checked_items(token_ids: Sequence[int], items: Sequence[MultiModalInput], pad_ids: int | Mapping[str, int],
                  hidden_size: int, *, allow_touching: bool = True,
                  sparse: Collection[str] = ()) -> list[MultiModalInput]:
    """`items` sorted by offset, after checking each against the prompt and every placeholder covered.

    `pad_ids`: the placeholder token per modality (an int: images only); `sparse`: modalities whose
    ranges may hold other tokens between the placeholders.  `allow_touching=False` also refuses items
    that touch (M-RoPE groups consecutive placeholders into one item, so two touching items would be
    positioned as one).
    """
    pads = {"image": pad_ids} if isinstance(pad_ids, int) else dict(pad_ids)
    ordered = sorted(items, key=lambda item: item.offset)
    end = -1
    covered = dict.fromkeys(pads, 0)
    for item in ordered:
        covered[item.modality] = covered.get(item.modality, 0) + check_item(
            token_ids, item, pads, hidden_size, item.modality in sparse)
        if item.offset < end or (item.offset == end and not allow_touching):
            raise InvalidMultiModalInput(f"multimodal item at offset {item.offset} overlaps or touches "
                                         f"the previous one (ends at {end})")
        end = item.offset + item.length
    for modality, pad in pads.items():
        placeholders = sum(1 for token in token_ids if token == pad)
        if placeholders != covered[modality]:
            raise InvalidMultiModalInput(f"prompt has {placeholders} {modality} placeholder tokens but the items "
                                         f"cover {covered[modality]}")
    return ordered


def check_item(token_ids: Sequence[int], item: MultiModalInput, pad_ids: Mapping[str, int], hidden_size: int,
               sparse: bool = False) -> int:
    """Raises unless the item fits the prompt; returns how many placeholders it covers (= its embedding rows)."""
    where = f"{item.modality} item [{item.offset}, {item.offset + item.length})"
    if item.modality not in pad_ids:
        raise InvalidMultiModalInput(f"{where}: supported modalities are {', '.join(pad_ids)}, not {item.modality!r}")
    if item.offset < 0 or item.length <= 0 or item.offset + item.length > len(token_ids):
        raise InvalidMultiModalInput(f"{where}: outside the prompt of {len(token_ids)} tokens")
    pad = pad_ids[item.modality]
    span = token_ids[item.offset:item.offset + item.length]
    count = sum(1 for token in span if token == pad)
    if not sparse and count != item.length:
        raise InvalidMultiModalInput(f"{where}: range holds tokens other than the {item.modality} token {pad}")
    if sparse and (span[0] == pad or count == 0):
        raise InvalidMultiModalInput(f"{where}: not a {item.modality} placeholder range (token {pad})")
    shape = None if item.embedding is None else tuple(item.embedding.shape)
    if shape is not None and shape != (count, hidden_size):
        raise InvalidMultiModalInput(f"{where}: embedding shape {shape} != "
                                     f"({count}, {hidden_size})")
    return count


def scatter(embeds: torch.Tensor, items: Sequence[MultiModalInput],
            runs: Sequence[Sequence[tuple[int, int]]] | None = None) -> torch.Tensor:
    """Writes each item's embedding over its placeholder rows of `embeds` ([1, L, hidden]), in place; `runs`
    (per item, `pad_runs`) places the rows of sparse items, else each item's whole range takes them."""
    for index, item in enumerate(items):
        rows = item.embedding.to(embeds.device, embeds.dtype)
        if runs is None:
            embeds[0, item.offset:item.offset + item.length] = rows
            continue
        used = 0
        for start, count in runs[index]:
            embeds[0, start:start + count] = rows[used:used + count]
            used += count
    return embeds
