"""Plain causal language models (Qwen2, Llama families) and the 1-D-position language model they share
with LLaVA.

A text model has no encode stage: `has_vision()` is False, so `epd serve`
starts no encoder and render refuses images.  Positions are the token index
(rope_delta 0); decode's position_ids are [B, 1].  `TextLanguage` optionally
scatters image embeddings at a placeholder token (LLaVA's `<image>`): with
1-D positions an image is just a run of ordinary positions.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.models.base import LanguageModel, ModelAdapter, MultiModalInput, PrefillInputs, RenderSpec, VisionModel
from services.models.items import checked_items, scatter
from services.models.loading import InvalidMultiModalInput, ModelLoadError, load_part

if TYPE_CHECKING:
    import torch


class TextLanguage(LanguageModel):
    """A decoder stack + LM head with 1-D positions; images (if `image_token_id`) replace placeholder rows."""

    def __init__(self, hf_model: Any, decoder: Any, path: str | Path, max_model_len: int | None,
                 image_token_id: int | None = None) -> None:
        self._hold(hf_model, decoder, path, max_model_len)
        self.image_token_id = image_token_id

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(token_ids.to(self.device))

    def decode_position_ids(self, positions: torch.Tensor) -> torch.Tensor:
        import torch

        rows = positions.to(self.device, torch.long)
        return rows[:, None] if rows.dim() == 1 else rows

    def prefill_inputs(self, token_ids: list[int], mm_items: list[MultiModalInput],
                       early: PrefillInputs | None = None) -> PrefillInputs:
        import torch

        items = self._check_items(token_ids, mm_items)
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        with torch.no_grad():
            embeds = scatter(self.embed(ids), items)
        positions = torch.arange(len(token_ids), device=self.device)[None]
        return PrefillInputs(inputs_embeds=embeds, position_ids=positions, rope_delta=0)

    def _check_items(self, token_ids: list[int], items: list[MultiModalInput]) -> list[MultiModalInput]:
        if self.image_token_id is None:
            if items:
                raise InvalidMultiModalInput("this model is text-only: it takes no multimodal items")
            return []
        return checked_items(token_ids, items, self.image_token_id, self.hidden_size)


class CausalLMAdapter(ModelAdapter):
    """`XForCausalLM` checkpoints: the whole model is the language part."""

    family = "causal_lm"
    architectures: tuple[str, ...] = ("Qwen2ForCausalLM", "LlamaForCausalLM")
    metadata_keys: tuple[str, ...] = ()

    def has_vision(self) -> bool:
        return False

    def render_spec(self, path: str | Path) -> RenderSpec:
        return RenderSpec(family=self.family)

    def load_vision(self, path: str | Path, device: str = "cpu", dtype: str = "float32") -> VisionModel:
        raise ModelLoadError(f"{path}: a text-only model has no vision tower (no encode role is needed)")

    def load_language(self, path: str | Path, device: str = "cpu", dtype: str = "float32",
                      max_model_len: int | None = None) -> LanguageModel:
        from transformers import AutoModelForCausalLM

        hf_model = load_part(AutoModelForCausalLM, path, device, dtype)
        return TextLanguage(hf_model, hf_model.model, path, max_model_len)
