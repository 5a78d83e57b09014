"""Qwen2-VL and Qwen2.5-VL: vision tower for encode, language model for prefill/decode.

Encode runs the tower exactly as `get_image_features` does (videos too: `get_video_features` is the
same forward), over all items' patches at once (attention inside the tower is per image and per
frame group, so batching does not mix items).  Prefill scatters each item's embedding at its
placeholders and takes M-RoPE positions from the grids (services/models/mrope.py: vLLM's
`get_mrope_input_positions`), which need only image_grid_thw / video_grid_thw (and Qwen2.5-VL's
second_per_grid_ts) and which tokens are placeholders, never pixels.  The returned rope_delta makes
decode positions plain integers: a decode token at sequence index n sits at n + rope_delta on all
three M-RoPE axes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.models.base import LanguageModel, ModelAdapter, MultiModalInput, PrefillInputs, RenderSpec, VisionModel
from services.models.input_norm import NormParams, normalize_pixels
from services.models.items import checked_items, scatter
from services.models.loading import InvalidMultiModalInput, load_part, read_config
from services.models.mrope import Segment, mrope_positions

if TYPE_CHECKING:
    import torch


GRID_KEYS = ("image_grid_thw", "video_grid_thw")


def _grid(metadata: dict[str, torch.Tensor]) -> torch.Tensor:
    """The item's patch grid [t, h, w]: image_grid_thw, or a video's video_grid_thw."""
    for key in GRID_KEYS:
        if key in metadata:
            return metadata[key].reshape(3).long()
    raise InvalidMultiModalInput(f"item lacks image_grid_thw and video_grid_thw (has {sorted(metadata)})")


class QwenVLVision(VisionModel):
    """The vision tower (patch embed, blocks, merger) of a Qwen-VL checkpoint."""

    frame_groups_independent = True   # attention per temporal patch; tests/services/encode/test_frame_groups.py

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
        """The item's float pixels: uint8 ones normalised (vLLM's formula), float ones as they came.  A video's
        pixel_values_videos go through the same tower call as an image's (transformers' get_video_features
        and get_image_features are one forward): attention never leaves a frame group."""
        key = "pixel_values_videos" if "pixel_values_videos" in item else "pixel_values"
        pixels = item.get(key)
        if pixels is None or pixels.dim() != 2 or pixels.shape[0] != int(grid.prod()):
            shape = None if pixels is None else tuple(pixels.shape)
            raise InvalidMultiModalInput(
                f"{key} shape {shape} does not match the grid {grid.tolist()} "
                f"(expected [{int(grid.prod())}, patch_dim])")
        return normalize_pixels(pixels, self.norm)


class QwenVLLanguage(LanguageModel):
    """The text decoder stack and LM head of a Qwen-VL checkpoint, with M-RoPE position rules."""

    def __init__(self, hf_model: Any, path: str | Path, max_model_len: int | None) -> None:
        self._hold(hf_model, hf_model.model.language_model, path, max_model_len)
        self._base = hf_model.model  # owns get_rope_index
        self.image_token_id = int(hf_model.config.image_token_id)
        self.video_token_id = getattr(hf_model.config, "video_token_id", None)

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
        runs = [[(seg.offset, seg.tokens) for seg in self.segments(token_ids, item)] for item in items]
        with torch.no_grad():
            embeds = scatter(early.inputs_embeds, items, runs)
        return PrefillInputs(inputs_embeds=embeds, position_ids=early.position_ids, rope_delta=early.rope_delta)

    def early_inputs(self, token_ids: list[int], mm_items: list[MultiModalInput]) -> PrefillInputs:
        import torch

        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        with torch.no_grad():
            embeds = self.embed(ids)
        position_ids, rope_delta = self._positions(token_ids, sorted(mm_items, key=lambda item: item.offset))
        return PrefillInputs(inputs_embeds=embeds, position_ids=position_ids, rope_delta=rope_delta)

    def segments(self, token_ids: Sequence[int], item: MultiModalInput) -> list[Segment]:
        """The item's placeholder runs with their grids (services/models/mrope.py)."""
        grid = tuple(int(v) for v in _grid(item.metadata).tolist())
        if item.modality == "image":
            if grid[0] != 1:
                raise InvalidMultiModalInput(f"image item at {item.offset}: image_grid_thw {list(grid)} has t != 1")
            return [Segment(item.offset, item.length, grid)]  # type: ignore[arg-type]
        return self.video_segments(token_ids, item, grid)  # type: ignore[arg-type]

    def video_segments(self, token_ids: Sequence[int], item: MultiModalInput,
                       grid: tuple[int, int, int]) -> list[Segment]:
        """A Qwen2-VL / Qwen2.5-VL video: one run of all its frame groups, Qwen2.5-VL's spaced in time."""
        return [Segment(item.offset, item.length, grid, self._t_factor(item))]

    def _t_factor(self, item: MultiModalInput) -> float:
        """vLLM's t_factor: second_per_grid_ts (its stored value, as a Python float) * tokens_per_second, for
        towers with a time scale (Qwen2.5-VL); 1 otherwise."""
        tokens_per_second = getattr(self._base.config.vision_config, "tokens_per_second", None)
        seconds = item.metadata.get("second_per_grid_ts")
        if tokens_per_second is None or seconds is None:
            return 1.0
        return float(seconds.reshape(-1)[0].item()) * tokens_per_second

    def _positions(self, token_ids: Sequence[int], items: list[MultiModalInput]) -> tuple[torch.Tensor, int]:
        import torch

        if not items:
            return self.decode_position_ids(torch.arange(len(token_ids))[None]), 0
        merge = self._base.config.vision_config.spatial_merge_size
        segments = [seg for item in items for seg in self.segments(token_ids, item)]
        positions, delta = mrope_positions(len(token_ids), segments, merge)
        return torch.from_numpy(positions)[:, None].to(self.device), delta

    sparse_modalities: tuple[str, ...] = ()   # a Qwen3-VL video's range holds its timestamps too

    def _check_items(self, token_ids: list[int], mm_items: list[MultiModalInput]) -> list[MultiModalInput]:
        # get_rope_index groups consecutive placeholders: touching items would merge into one
        pads = {"image": self.image_token_id}
        if self.video_token_id is not None:
            pads["video"] = int(self.video_token_id)
        items = checked_items(token_ids, mm_items, pads, self.hidden_size, allow_touching=False,
                              sparse=self.sparse_modalities)
        merge = self._base.config.vision_config.spatial_merge_size
        for item in items:
            grid = _grid(item.metadata).tolist()
            covered = sum(seg.tokens for seg in self.segments(token_ids, item))
            if int(_grid(item.metadata).prod()) // merge**2 != covered:
                raise InvalidMultiModalInput(f"{item.modality} item at {item.offset}: grid {grid} does not give "
                                             f"{covered} tokens")
        return items


# The light fields prefill still needs (mm_metadata): positions come from the grids, Qwen2.5-VL's video
# positions from second_per_grid_ts, Qwen3-VL's video prompt from its timestamps.
QWEN_VL_METADATA_KEYS = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts", "timestamps")


def qwen_vl_render_spec(family: str, path: str | Path) -> RenderSpec:
    """Qwen-VL prompts: <|vision_start|> + a run of <|image_pad|> (<|video_pad|>) + <|vision_end|> per item."""
    config = read_config(path)
    return RenderSpec(family=family, image_token_id=int(config.get("image_token_id", 151655)),
                      start_token_id=int(config.get("vision_start_token_id", 151652)),
                      end_token_id=int(config.get("vision_end_token_id", 151653)),
                      metadata_keys=QWEN_VL_METADATA_KEYS,
                      video_token_id=int(config.get("video_token_id", 151656)))


class Qwen2VLAdapter(ModelAdapter):
    family = "qwen2_vl"
    architectures: tuple[str, ...] = ("Qwen2VLForConditionalGeneration",)
    metadata_keys: tuple[str, ...] = QWEN_VL_METADATA_KEYS
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
