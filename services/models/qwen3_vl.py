"""Qwen3-VL: a Qwen-VL split whose tower also yields "deepstack" features.

The tower returns, besides the merged embedding, one feature map per
`deepstack_visual_indexes` layer; the language model adds map k to the hidden
states of the image tokens after decoder layer k.  Encode therefore stores one
EC entry per item holding two tensors, "embedding" [n, hidden] and
"deepstack" [num_deepstack_layers, n, hidden]; prefill receives the second as
`MultiModalInput.extras["deepstack"]` and feeds it back through the text
model's own `visual_pos_masks` / `deepstack_visual_embeds` arguments (what
`mm_encoder_outputs` resolves to inside transformers); in a packed forward of several prompts
(or a chunk of one) `packed_kwargs` builds them for exactly the rows the forward runs.  Positions are
Qwen2-VL's: M-RoPE from `get_rope_index`, rope_delta to decode.  Decode needs
nothing new: deepstack touches prompt tokens only.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from services.models.base import MultiModalInput, PrefillInputs
from services.models.loading import InvalidMultiModalInput
from services.models.mrope import Segment, pad_runs
from services.models.qwen2_vl import Qwen2VLAdapter, QwenVLLanguage, QwenVLVision, _grid

if TYPE_CHECKING:
    import torch

DEEPSTACK = "deepstack"
VISUAL_MASK = "visual_mask"


class Qwen3VLVision(QwenVLVision):
    """The Qwen3-VL tower: embeddings plus per-layer deepstack features."""

    token_dims = MappingProxyType({"embedding": 0, DEEPSTACK: 1})   # deepstack: [layers, tokens, hidden]

    def encode(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        return [entry["embedding"] for entry in self.encode_entries(items)]

    def encode_entries(self, items: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        import torch

        if not items:
            return []
        grids = torch.stack([_grid(item) for item in items])
        pixels = torch.cat([self._pixels(item, grid) for item, grid in zip(items, grids, strict=True)])
        with torch.no_grad():
            out = self._base.get_image_features(pixels.to(self.device), grids.to(self.device))
        # deepstack_features: per layer, a tuple split per item -> per item, [layers, n, hidden]
        stacks = [torch.stack(per_layer) for per_layer in zip(*out.deepstack_features, strict=True)]
        return [{"embedding": embedding, DEEPSTACK: stack}
                for embedding, stack in zip(out.pooler_output, stacks, strict=True)]


class Qwen3VLLanguage(QwenVLLanguage):
    """Qwen-VL positions and scatter, plus the deepstack features of the prompt's images and videos.

    A Qwen3-VL video's placeholder range is its HF processor's expansion: per frame group a timestamp
    ("<0.2 seconds>"), <|vision_start|>, the group's pads, <|vision_end|>.  Its embedding rows go to the
    pads in order, and each group is positioned as an image of its own (t = 1), the timestamp text
    between them counting as text: what transformers' get_rope_index and vLLM do."""

    sparse_modalities = ("video",)

    def __init__(self, hf_model: Any, path: str | Path, max_model_len: int | None) -> None:
        super().__init__(hf_model, path, max_model_len)
        self.num_deepstack = len(hf_model.config.vision_config.deepstack_visual_indexes)

    def video_segments(self, token_ids: Sequence[int], item: MultiModalInput,
                       grid: tuple[int, int, int]) -> list[Segment]:
        t, h, w = grid
        runs = pad_runs(token_ids, item.offset, item.length, int(self.video_token_id))   # type: ignore[arg-type]
        per_group = h * w // self._base.config.vision_config.spatial_merge_size**2
        if len(runs) != t or any(count != per_group for _, count in runs):
            raise InvalidMultiModalInput(f"video item at {item.offset}: expected {t} frame groups of {per_group} "
                                         f"placeholders, found runs {[count for _, count in runs]}")
        return [Segment(start, count, (1, h, w)) for start, count in runs]

    def prefill_inputs(self, token_ids: list[int], mm_items: list[MultiModalInput],
                       early: PrefillInputs | None = None) -> PrefillInputs:
        import torch

        inputs = super().prefill_inputs(token_ids, mm_items, early)
        items = sorted(mm_items, key=lambda item: item.offset)
        if items and self.num_deepstack:
            for item in items:
                self._check_deepstack(item, token_ids)
            mask = torch.zeros(len(token_ids), dtype=torch.bool, device=self.device)
            for item in items:
                for seg in self.segments(token_ids, item):
                    mask[seg.offset:seg.offset + seg.tokens] = True
            # one [num_visual_tokens, hidden] map per deepstack layer, rows in prompt order (= mask order)
            layers = torch.cat([item.extras[DEEPSTACK] for item in items], dim=1).to(self.device)
            inputs.extras = {VISUAL_MASK: mask, DEEPSTACK: layers}
        return inputs

    def packed_kwargs(self, chunks: Sequence[tuple[PrefillInputs, int, int]]) -> dict[str, Any]:
        """visual_pos_masks over the packed rows and, per deepstack layer, the features of the visual rows
        among them in the same order; {} when no chunk holds an image row."""
        import torch

        masks, features = [], []
        for inputs, start, end in chunks:
            mask = inputs.extras.get(VISUAL_MASK)
            if mask is None:
                masks.append(torch.zeros(end - start, dtype=torch.bool, device=self.device))
                continue
            skipped, count = int(mask[:start].sum()), int(mask[start:end].sum())
            masks.append(mask[start:end])
            if count:
                features.append(inputs.extras[DEEPSTACK][:, skipped:skipped + count])
        if not features:
            return {}
        layers = torch.cat(features, dim=1)
        return {"visual_pos_masks": torch.cat(masks)[None], "deepstack_visual_embeds": list(layers)}

    def _check_deepstack(self, item: MultiModalInput, token_ids: Sequence[int]) -> None:
        stack = item.extras.get(DEEPSTACK)
        expected = (self.num_deepstack, sum(seg.tokens for seg in self.segments(token_ids, item)), self.hidden_size)
        if stack is None or tuple(stack.shape) != expected:
            got = None if stack is None else tuple(stack.shape)
            raise InvalidMultiModalInput(f"{item.modality} item at {item.offset}: EC entry lacks deepstack features "
                                         f"of shape {expected} (got {got})")


class Qwen3VLAdapter(Qwen2VLAdapter):
    """Qwen-VL split; the EC entry carries the deepstack features with the embedding."""

    family = "qwen3_vl"
    architectures = ("Qwen3VLForConditionalGeneration",)
    vision_class = Qwen3VLVision
    language_class = Qwen3VLLanguage
