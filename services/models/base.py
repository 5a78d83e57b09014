"""The model-adapter contract: what a role needs from a model family.

Roles never touch a family's internals; they call an adapter chosen by
`services.models.registry.adapter_for` from the checkpoint's config.json.  The
split of a VLM into parts:

- encode holds a `VisionModel`: kwargs items (decoded PROTOCOL.md items as
  torch tensors) -> one embedding tensor per item, in the model dtype, stored
  in the EC store as one entry of named tensors (`encode_entries`: the
  "embedding" plus whatever else the family's language model needs, which
  prefill hands back as `MultiModalInput.extras`);
- prefill and decode hold a `LanguageModel`: token embeddings, the decoder
  stack (a Hugging Face module that accepts inputs_embeds, position_ids,
  attention_mask and a cache), the LM head, and the family's position rules.

Per-request position state (Qwen-VL's rope_delta) is computed by prefill and
carried to decode in kv_transfer_params (0 for families with 1-D positions); decode's position for a token is
"index of the token in the sequence + rope_delta" (prompt tokens count; for the
first token fed to decode that index is the prompt length).

KV layout between prefill and decode: one tensor [num_layers, 2, num_kv_heads,
L, head_dim] (index 0 = keys, 1 = values) in `KVLayout.dtype`, the model dtype.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class KVLayout:
    """Shape facts the decode engine needs to preallocate its KV buffers."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: Any  # torch.dtype
    max_model_len: int


@dataclass
class PrefillInputs:
    """Everything the decoder stack needs for one prompt (batch of one)."""

    inputs_embeds: torch.Tensor   # [1, L, hidden], model dtype
    position_ids: torch.Tensor    # family shaped, int64: [1, L] or [3, 1, L] (M-RoPE)
    rope_delta: int               # carried to decode; 0 for text-only prompts
    # Family-specific per-prompt tensors that `LanguageModel.packed_kwargs` turns into forward kwargs
    # (Qwen3-VL: which rows are visual and their deepstack features).
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass
class MultiModalInput:
    """One item as prefill sees it: where it sits, its metadata, its embedding."""

    modality: str
    offset: int
    length: int
    metadata: dict[str, torch.Tensor]
    embedding: torch.Tensor  # [length, hidden]
    mm_hash: str | None = None  # content hash (PROTOCOL.md); keys prefix-cache blocks holding the item
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # the EC entry's other tensors (deepstack)


class VisionModel(ABC):
    """The vision tower of a family (encode role). Holds no language-model weights."""

    hidden_size: int    # embedding width = the language model's hidden size
    dtype: Any          # torch.dtype of the embeddings `encode` returns
    tower: Any = None   # the nn.Module holding the vision weights (services.models.prepack swaps its linears)
    patches_per_token: int = 1  # patches the tower runs on per embedding token (forward_cost.py)
    # A video's frame groups (temporal patches) encode to the same bits alone as inside any video: encode then
    # stores videos per group (services/encode/frame_groups.py).  True only where a test showed it.
    frame_groups_independent: bool = False
    # The token axis of each tensor of an EC entry (how a video's group entries join).
    token_dims: Mapping[str, int] = MappingProxyType({"embedding": 0})

    @abstractmethod
    def encode(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """One forward for all items; returns one [num_tokens, hidden] tensor per item."""

    @abstractmethod
    def num_tokens(self, metadata: dict[str, torch.Tensor]) -> int:
        """Placeholder tokens an item occupies, from its metadata (e.g. image_grid_thw)."""

    def encode_entries(self, items: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        """What the EC store holds per item: {"embedding": [num_tokens, hidden]} plus any tensors the
        family's language model also needs (Qwen3-VL: "deepstack" [num_deepstack_layers, num_tokens, hidden])."""
        return [{"embedding": embedding} for embedding in self.encode(items)]


class LanguageModel(ABC):
    """The language model of a family (prefill and decode roles). Holds no vision weights.

    `model(inputs_embeds=, position_ids=, attention_mask=, cache=, use_cache=True)`
    returns an object with `last_hidden_state`; `past_key_values=` is the old
    spelling of `cache=` and still works (with a deprecation warning).  A 4-D
    attention_mask ([B, 1, q, L], additive float) is used as is.
    """

    model: Any          # the HF decoder stack (its nn.Linear layers may be swapped at load: prepack.py)
    lm_head: Any        # hidden -> logits (an nn.Linear, or prepack.PackedLinear after the swap)
    layout: KVLayout
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    hidden_size: int
    device: Any         # torch.device of every parameter

    def _hold(self, hf_model: Any, decoder: Any, path: str | Path, max_model_len: int | None) -> None:
        """Take a loaded checkpoint's decoder stack, LM head and the shape facts of its text config."""
        from services.models.loading import eos_token_ids

        text = decoder.config
        self.model, self.lm_head, self.device = decoder, hf_model.lm_head, hf_model.device
        self.vocab_size, self.hidden_size = int(text.vocab_size), int(text.hidden_size)
        self.eos_token_ids = eos_token_ids(path, hf_model.config)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self.layout = KVLayout(num_layers=text.num_hidden_layers, num_kv_heads=text.num_key_value_heads,
                               head_dim=head_dim, dtype=hf_model.dtype,
                               max_model_len=max_model_len or text.max_position_embeddings)

    @abstractmethod
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[B, L] ids -> [B, L, hidden] embeddings."""

    @abstractmethod
    def prefill_inputs(self, token_ids: list[int], mm_items: list[MultiModalInput],
                       early: PrefillInputs | None = None) -> PrefillInputs:
        """Embeddings with item embeddings scattered in, and positions, for one prompt; `early`: what
        `early_inputs` made of the same prompt before the embeddings came (its embeddings are written in place).

        Raises ValueError when an item's range does not hold its placeholder
        tokens, its embedding has the wrong number of rows, or a placeholder
        token is not covered by an item.
        """

    def early_inputs(self, token_ids: list[int], mm_items: list[MultiModalInput]) -> PrefillInputs | None:
        """What of the prompt's inputs needs no item embedding (the text's embeddings, the positions), made while
        they are on their way (a prefill called ahead of its inputs); `mm_items` carry their placement and
        metadata, no embedding.  None: nothing to make early (`prefill_inputs` makes it all)."""
        return None

    @abstractmethod
    def decode_position_ids(self, positions: torch.Tensor) -> torch.Tensor:
        """[B] (or [B, T]) absolute positions (token index + rope_delta) -> family-shaped
        position_ids for one step: Qwen-VL gives [3, B, 1] (or [3, B, T])."""

    def packed_kwargs(self, chunks: Sequence[tuple[PrefillInputs, int, int]]) -> dict[str, Any]:
        """Extra forward kwargs of one packed forward over rows [start, end) of each prompt, in order
        (the rows are concatenated into one sequence).  None by default; Qwen3-VL: deepstack."""
        return {}


@dataclass(frozen=True)
class RenderSpec:
    """What render needs to know about a family: its image placeholder and how long each run is.

    A prompt marks an image as start + a run of `image_token_id` + end (Qwen-VL) or as a bare run
    (LLaVA's `<image>`: start/end None).  The run length is `tokens_per_image` when the family's
    count is fixed (LLaVA), else it comes from image_grid_thw and `merge_size` (Qwen-VL).
    `image_token_id` None means a text-only model: render refuses images; `video_token_id` None
    a model without video: render refuses videos.
    """

    family: str
    image_token_id: int | None = None
    start_token_id: int | None = None
    end_token_id: int | None = None
    metadata_keys: tuple[str, ...] = ()
    tokens_per_image: int | None = None
    video_token_id: int | None = None

    @property
    def accepts_images(self) -> bool:
        return self.image_token_id is not None


class ModelAdapter(ABC):
    """One per family; chosen by `services.models.registry.adapter_for(model_path)`.

    Adapters are imported by render too: a module defining one must not import torch or
    transformers at module level.
    """

    family: str
    architectures: tuple[str, ...]
    metadata_keys: tuple[str, ...]   # processor fields prefill still needs (mm_metadata)

    @abstractmethod
    def load_vision(self, path: str | Path, device: str = "cpu", dtype: str = "float32") -> VisionModel: ...

    @abstractmethod
    def load_language(self, path: str | Path, device: str = "cpu", dtype: str = "float32",
                      max_model_len: int | None = None) -> LanguageModel: ...

    @abstractmethod
    def render_spec(self, path: str | Path) -> RenderSpec:
        """Placeholder tokens and metadata keys, read from the checkpoint's config.json (no torch)."""

    def has_vision(self) -> bool:
        return True
