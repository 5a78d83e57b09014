"""LLaVA: a CLIP-style tower + projector for encode, any causal LM for prefill/decode.

Encode runs `get_image_features` with the checkpoint's `vision_feature_layer`
(one layer or a list, concatenated) and `vision_feature_select_strategy`
("default" drops the first token, CLS for CLIP; "full" keeps it).  Each image
is a fixed-size crop, so it always occupies the same number of `<image>`
tokens: (image_size / patch_size)^2, +1 for a CLS token, -1 for "default".
Prefill scatters the embeddings at the `<image>` runs; positions are plain
1-D, so no metadata travels (metadata_keys is empty).  LLaVA-NeXT (any-res
tiles, image_sizes) is a different architecture and not supported.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.models.base import LanguageModel, ModelAdapter, RenderSpec, VisionModel
from services.models.causal_lm import TextLanguage
from services.models.loading import InvalidMultiModalInput, load_part

if TYPE_CHECKING:
    import torch

# Towers that prepend a CLS token to their patch tokens.
_CLS_TOWERS = frozenset({"clip_vision_model"})


def tokens_per_image(config: Any) -> int:
    """Placeholder tokens of one image for a LlavaConfig (also what the tower yields)."""
    vision = config.vision_config
    count = (int(vision.image_size) // int(vision.patch_size)) ** 2
    count += int(vision.model_type in _CLS_TOWERS)
    return count - int(config.vision_feature_select_strategy == "default")


class LlavaVision(VisionModel):
    """Vision tower + multimodal projector of a LLaVA checkpoint."""

    def __init__(self, hf_model: Any) -> None:
        self._base = hf_model.model
        self.tower = hf_model.model  # the module holding the vision weights (load-time kernel swaps)
        config = hf_model.config
        self.image_size = int(config.vision_config.image_size)
        self.feature_layer = config.vision_feature_layer
        self.strategy = config.vision_feature_select_strategy
        self.num_image_tokens = tokens_per_image(config)
        self.hidden_size = int(config.text_config.hidden_size)
        self.dtype = hf_model.dtype
        self.device = hf_model.device

    def num_tokens(self, metadata: dict[str, torch.Tensor]) -> int:
        return self.num_image_tokens

    def encode(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        import torch

        if not items:
            return []
        pixels = torch.cat([self._pixels(item) for item in items]).to(self.device, self.dtype)
        with torch.no_grad():
            out = self._base.get_image_features(pixel_values=pixels, vision_feature_layer=self.feature_layer,
                                                vision_feature_select_strategy=self.strategy)
        return list(out.pooler_output)

    def _pixels(self, item: dict[str, torch.Tensor]) -> torch.Tensor:
        pixels = item.get("pixel_values")
        expected = (1, 3, self.image_size, self.image_size)
        if pixels is None or tuple(pixels.shape) != expected:
            shape = None if pixels is None else tuple(pixels.shape)
            raise InvalidMultiModalInput(f"pixel_values shape {shape} != {expected}")
        return pixels


class LlavaAdapter(ModelAdapter):
    family = "llava"
    architectures: tuple[str, ...] = ("LlavaForConditionalGeneration",)
    metadata_keys: tuple[str, ...] = ()

    def render_spec(self, path: str | Path) -> RenderSpec:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(path))
        return RenderSpec(family=self.family, image_token_id=int(config.image_token_id),
                          metadata_keys=self.metadata_keys, tokens_per_image=tokens_per_image(config))

    def load_vision(self, path: str | Path, device: str = "cpu", dtype: str = "float32") -> VisionModel:
        from services.models.hf_parts import part_classes

        return LlavaVision(load_part(part_classes(self.family)[0], path, device, dtype))

    def load_language(self, path: str | Path, device: str = "cpu", dtype: str = "float32",
                      max_model_len: int | None = None) -> LanguageModel:
        from services.models.hf_parts import part_classes

        hf_model = load_part(part_classes(self.family)[1], path, device, dtype)
        return TextLanguage(hf_model, hf_model.model.language_model, path, max_model_len,
                            image_token_id=int(hf_model.config.image_token_id))
