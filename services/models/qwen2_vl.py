"""Qwen2-VL and Qwen2.5-VL: vision tower for encode, language model for prefill/decode.

Encode runs the tower exactly as `get_image_features` does, over all items'
patches at once (attention inside the tower is per image, so batching does not
mix items).  Prefill scatters each item's embedding at its placeholder range
and takes M-RoPE positions from the model's own `get_rope_index`, which needs
only image_grid_thw and which tokens are image tokens, never pixels.  The
returned rope_delta makes decode positions plain integers: a decode token at
sequence index n sits at n + rope_delta on all three M-RoPE axes.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.models.base import (
    KVLayout,
    LanguageModel,
    ModelAdapter,
    MultiModalInput,
    PrefillInputs,
    RenderSpec,
    VisionModel,
)
from services.models.input_norm import NormParams, normalize_pixels
from services.models.items import checked_items, scatter
from services.models.loading import InvalidMultiModalInput, eos_token_ids, load_part, read_config

if TYPE_CHECKING:
    import torch


def _grid(metadata: dict[str, torch.Tensor]) -> torch.Tensor:
    if "image_grid_thw" not in metadata:
        raise InvalidMultiModalInput(f"image item lacks image_grid_thw (has {sorted(metadata)})")
    return metadata["image_grid_thw"].reshape(3).long()


class QwenVLVision(VisionModel):
    """The vision tower (patch embed, blocks, merger) of a Qwen-VL checkpoint."""

    def __init__(self, hf_model: Any) -> None:
        self._base = hf_model.model
        self.tower = hf_model.model  # the module holding the vision weights (load-time kernel swaps)
        self.merge_size = int(hf_model.config.vision_config.spatial_merge_size)
        self.patches_per_token = self.merge_size**2  # the tower runs on patches; each token merges this many
        self.hidden_size = int(hf_model.config.text_config.hidden_size)
        self.dtype = hf_model.dtype
        self.device = hf_model.device
        # uint8 pixels (vLLM's default, and epd render's) are normalised here, as vLLM's tower does.
        self.norm = NormParams.from_checkpoint(hf_model.config._name_or_path)

    def num_tokens(self, metadata: dict[str, torch.Tensor]) -> int:
        return int(_grid(metadata).prod()) // self.merge_size**2

    def encode(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        import torch

        if not items:
            return []
        grids = torch.stack([_grid(item) for item in items])
        pixels = torch.cat([self._pixels(item, grid) for item, grid in zip(items, grids, strict=True)])
        with torch.no_grad():  # not inference_mode: callers may write into the results
            out = self._base.get_image_features(pixels.to(self.device), grids.to(self.device))
        return list(out.pooler_output)

    def _pixels(self, item: dict[str, torch.Tensor], grid: torch.Tensor) -> torch.Tensor:
        """The item's float pixels: uint8 ones normalised (vLLM's formula), float ones as they came."""
        pixels = item.get("pixel_values")
        if pixels is None or pixels.dim() != 2 or pixels.shape[0] != int(grid.prod()):
            shape = None if pixels is None else tuple(pixels.shape)
            raise InvalidMultiModalInput(
                f"pixel_values shape {shape} does not match image_grid_thw {grid.tolist()} "
                f"(expected [{int(grid.prod())}, patch_dim])")
        return normalize_pixels(pixels, self.norm)


class QwenVLLanguage(LanguageModel):
    """The text decoder stack and LM head of a Qwen-VL checkpoint, with M-RoPE position rules."""

    def __init__(self, hf_model: Any, path: str | Path, max_model_len: int | None) -> None:
        text = hf_model.config.text_config
        self._base = hf_model.model  # owns get_rope_index
        self.model = hf_model.model.language_model
        self.lm_head = hf_model.lm_head
        self.image_token_id = int(hf_model.config.image_token_id)
        self.video_token_id = getattr(hf_model.config, "video_token_id", None)
        self.vocab_size = int(text.vocab_size)
        self.hidden_size = int(text.hidden_size)
        self.device = hf_model.device
        self.eos_token_ids = eos_token_ids(path, hf_model.config)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self.layout = KVLayout(num_layers=text.num_hidden_layers, num_kv_heads=text.num_key_value_heads,
                               head_dim=head_dim, dtype=hf_model.dtype,
                               max_model_len=max_model_len or text.max_position_embeddings)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(token_ids.to(self.device))

    def decode_position_ids(self, positions: torch.Tensor) -> torch.Tensor:
        import torch

        rows = positions.to(self.device, torch.long)
        rows = rows[:, None] if rows.dim() == 1 else rows
        return rows[None].expand(3, -1, -1)

    def prefill_inputs(self, token_ids: list[int], mm_items: list[MultiModalInput],
                       early: PrefillInputs | None = None) -> PrefillInputs:
        import torch

        items = self._check_items(token_ids, mm_items)
        if early is None:
            early = self.early_inputs(token_ids, items)
        with torch.no_grad():
            embeds = scatter(early.inputs_embeds, items)
        return PrefillInputs(inputs_embeds=embeds, position_ids=early.position_ids, rope_delta=early.rope_delta)

    def early_inputs(self, token_ids: list[int], mm_items: list[MultiModalInput]) -> PrefillInputs:
        import torch

        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        with torch.no_grad():
            embeds = self.embed(ids)
        position_ids, rope_delta = self._positions(ids, sorted(mm_items, key=lambda item: item.offset))
        return PrefillInputs(inputs_embeds=embeds, position_ids=position_ids, rope_delta=rope_delta)

    def _positions(self, ids: torch.Tensor, items: list[MultiModalInput]) -> tuple[torch.Tensor, int]:
        import torch

        if not items:
            return self.decode_position_ids(torch.arange(ids.shape[1])[None]), 0
        merge = self._base.config.vision_config.spatial_merge_size
        positions, delta = mrope_positions(ids.shape[1], [(i.offset, i.length, _grid(i.metadata).tolist())
                                                          for i in items], merge)
        return torch.from_numpy(positions)[:, None].to(self.device), delta

    def hf_positions(self, ids: torch.Tensor, items: list[MultiModalInput]) -> tuple[torch.Tensor, int]:
        """The model's own `get_rope_index` for the same prompt (what `mrope_positions` reproduces; tests)."""
        import torch

        token_types = torch.zeros_like(ids)
        for item in items:
            token_types[0, item.offset:item.offset + item.length] = 1
        grids = torch.stack([_grid(item.metadata) for item in items]).to(self.device)
        position_ids, deltas = self._base.get_rope_index(ids, token_types, image_grid_thw=grids)
        return position_ids, int(deltas.reshape(-1)[0])

    def _check_items(self, token_ids: list[int], mm_items: list[MultiModalInput]) -> list[MultiModalInput]:
        # get_rope_index groups consecutive image tokens: touching items would merge into one image
        items = checked_items(token_ids, mm_items, self.image_token_id, self.hidden_size, allow_touching=False)
        if self.video_token_id is not None and self.video_token_id in token_ids:
            raise InvalidMultiModalInput("video placeholders are not supported by this server")
        merge = self._base.config.vision_config.spatial_merge_size
        for item in items:
            if int(_grid(item.metadata).prod()) // merge**2 != item.length:
                raise InvalidMultiModalInput(f"image item at {item.offset}: image_grid_thw "
                                             f"{_grid(item.metadata).tolist()} does not give {item.length} tokens")
        return items


def mrope_positions(length: int, images: list[tuple[int, int, list[int]]], merge: int) -> tuple[Any, int]:
    """M-RoPE positions [3, length] (int64 numpy) and rope_delta of a prompt whose images sit at
    (offset, tokens, [t, h, w] patch grid), in order and apart: what Qwen2-VL, Qwen2.5-VL and Qwen3-VL's
    `get_rope_index` give for images, without its per-token Python grouping (~0.14 ms for a 124-token
    prompt, 0.23 ms for 1,096, against ~0.02 ms here).  Text runs count on from the last position on all
    three axes; an image's tokens take (start + t, start + row, start + column) over its merged grid, and
    the text after it starts at start + max(merged rows, merged columns).  tests/services/models/
    test_mrope.py checks it against each family's `get_rope_index`."""
    import numpy as np

    positions = np.empty((3, length), dtype=np.int64)
    at = start = 0
    for offset, tokens, (t, h, w) in images:
        positions[:, at:offset] = np.arange(start, start + offset - at)
        start += offset - at
        rows, cols = h // merge, w // merge
        if t * rows * cols != tokens:
            raise InvalidMultiModalInput(f"image item at {offset}: grid {[t, h, w]} does not give {tokens} tokens")
        span = slice(offset, offset + tokens)
        positions[0, span] = np.repeat(start + np.arange(t), rows * cols)
        positions[1, span] = np.tile(np.repeat(start + np.arange(rows), cols), t)
        positions[2, span] = np.tile(start + np.arange(cols), t * rows)
        start += max(h, w) // merge
        at = offset + tokens
    positions[:, at:] = np.arange(start, start + length - at)
    return positions, int(positions.max()) + 1 - length


def qwen_vl_render_spec(family: str, path: str | Path) -> RenderSpec:
    """Qwen-VL prompts: <|vision_start|> + a run of <|image_pad|> + <|vision_end|> per image."""
    config = read_config(path)
    return RenderSpec(family=family, image_token_id=int(config.get("image_token_id", 151655)),
                      start_token_id=int(config.get("vision_start_token_id", 151652)),
                      end_token_id=int(config.get("vision_end_token_id", 151653)),
                      metadata_keys=("image_grid_thw",))


class Qwen2VLAdapter(ModelAdapter):
    family = "qwen2_vl"
    architectures: tuple[str, ...] = ("Qwen2VLForConditionalGeneration",)
    metadata_keys: tuple[str, ...] = ("image_grid_thw",)
    vision_class: type[QwenVLVision] = QwenVLVision
    language_class: type[QwenVLLanguage] = QwenVLLanguage

    def render_spec(self, path: str | Path) -> RenderSpec:
        return qwen_vl_render_spec(self.family, path)

    def load_vision(self, path: str | Path, device: str = "cpu", dtype: str = "float32") -> VisionModel:
        from services.models.hf_parts import part_classes

        return self.vision_class(load_part(part_classes(self.family)[0], path, device, dtype))

    def load_language(self, path: str | Path, device: str = "cpu", dtype: str = "float32",
                      max_model_len: int | None = None) -> LanguageModel:
        from services.models.hf_parts import part_classes

        hf_model = load_part(part_classes(self.family)[1], path, device, dtype)
        return self.language_class(hf_model, path, max_model_len)


class Qwen2_5_VLAdapter(Qwen2VLAdapter):
    """Same split; the tower differs (window attention, `out_hidden_size` = LM width)."""

    family = "qwen2_5_vl"
    architectures = ("Qwen2_5_VLForConditionalGeneration",)
