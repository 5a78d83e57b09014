"""Hugging Face classes that hold only one part of a VLM checkpoint (Qwen-VL, LLaVA).

Each part class keeps the module paths of the full `...ForConditionalGeneration`
(`model.visual.*` or `model.vision_tower.*` + `model.multi_modal_projector.*`,
`model.language_model.*`, `lm_head`) so that `from_pretrained`
loads it from an unmodified checkpoint: the other part's keys are declared
ignorable, weight tying (`lm_head` <- `embed_tokens` when tie_word_embeddings)
still applies, and transformers' own rename rules for older checkpoint layouts
(`visual.*`, `model.layers.*`) are registered for the part class names too,
because transformers looks those rules up by class name.

Imports transformers at module level: import this module lazily.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping


@dataclass(frozen=True)
class FamilyClasses:
    """The transformers classes of one VLM family."""

    full: Any         # XForConditionalGeneration (a class)
    base: Any         # XModel (vision modules + language_model)
    pretrained: Any   # XPreTrainedModel
    vision: Callable[[Any], dict[str, nn.Module]]  # config -> the base model's vision modules, by attribute
    text: Callable[[Any], nn.Module]               # config -> the text decoder stack
    vision_attrs: tuple[str, ...] = ("visual",)    # attribute names `vision` returns (checkpoint prefixes)


def make_part_classes(family: FamilyClasses) -> tuple[type, type]:
    """(vision-only class, language-only class) for a family, loadable with from_pretrained."""
    prefix = family.full.__name__.removesuffix("ForConditionalGeneration")

    def vision_base_init(self, config):
        family.pretrained.__init__(self, config)
        for name, module in family.vision(config).items():
            setattr(self, name, module)
        self.post_init()

    def vision_full_init(self, config):
        family.pretrained.__init__(self, config)
        self.model = vision_base(config)
        self.post_init()

    def text_base_init(self, config):
        family.pretrained.__init__(self, config)
        self.language_model = family.text(config)
        self.rope_deltas = None
        self.post_init()

    def text_full_init(self, config):
        family.pretrained.__init__(self, config)
        self.model = text_base(config)
        text_config = config.text_config
        self.lm_head = nn.Linear(text_config.hidden_size, text_config.vocab_size, bias=False)
        self.post_init()

    vision_base = type(f"{prefix}VisionPartModel", (family.base,), {"__init__": vision_base_init})
    vision_full = type(f"{prefix}VisionPart", (family.full,), {
        "__init__": vision_full_init,
        "_tied_weights_keys": {},  # no lm_head here
        "_keys_to_ignore_on_load_unexpected": [r"^model\.language_model\.", r"^lm_head\."],
    })
    text_base = type(f"{prefix}LanguagePartModel", (family.base,), {"__init__": text_base_init})
    text_full = type(f"{prefix}LanguagePart", (family.full,), {
        "__init__": text_full_init,
        "_keys_to_ignore_on_load_unexpected": [rf"^model\.{name}\." for name in family.vision_attrs],
    })
    # Our classes count as custom code, which gets no renames unless registered by name; transformers
    # keys them by class name or by model_type (LLaVA: "llava" for the full model, "LlavaModel" inside).
    _inherit_renames((family.full.__name__, family.full.config_class.model_type), (vision_full, text_full))
    _inherit_renames((family.base.__name__,), (vision_base, text_base))
    return vision_full, text_full


def _inherit_renames(lookups: tuple[str, ...], classes: tuple[type, ...]) -> None:
    for cls in classes:
        for lookup in lookups:
            # a fresh copy per class: registered transforms get scoped to their model
            renames = get_checkpoint_conversion_mapping(lookup)
            if renames is not None:
                register_checkpoint_conversion_mapping(cls.__name__, renames, overwrite=True)
                break


def _qwen_family(full: Any, base: Any, pretrained: Any, vision: Any, text: Any) -> FamilyClasses:
    return FamilyClasses(full, base, pretrained,
                         vision=lambda config: {"visual": vision._from_config(config.vision_config)},
                         text=lambda config: text._from_config(config.text_config))


def qwen2_vl_classes() -> FamilyClasses:
    from transformers.models.qwen2_vl import modeling_qwen2_vl as m

    return _qwen_family(m.Qwen2VLForConditionalGeneration, m.Qwen2VLModel, m.Qwen2VLPreTrainedModel,
                        m.Qwen2VisionTransformerPretrainedModel, m.Qwen2VLTextModel)


def qwen2_5_vl_classes() -> FamilyClasses:
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m

    return _qwen_family(m.Qwen2_5_VLForConditionalGeneration, m.Qwen2_5_VLModel, m.Qwen2_5_VLPreTrainedModel,
                        m.Qwen2_5_VisionTransformerPretrainedModel, m.Qwen2_5_VLTextModel)


def qwen3_vl_classes() -> FamilyClasses:
    from transformers.models.qwen3_vl import modeling_qwen3_vl as m

    return _qwen_family(m.Qwen3VLForConditionalGeneration, m.Qwen3VLModel, m.Qwen3VLPreTrainedModel,
                        m.Qwen3VLVisionModel, m.Qwen3VLTextModel)


def llava_classes() -> FamilyClasses:
    from transformers import AutoModel
    from transformers.models.llava import modeling_llava as m

    def vision(config: Any) -> dict[str, nn.Module]:
        return {"vision_tower": AutoModel.from_config(config.vision_config),
                "multi_modal_projector": m.LlavaMultiModalProjector(config)}

    return FamilyClasses(m.LlavaForConditionalGeneration, m.LlavaModel, m.LlavaPreTrainedModel, vision=vision,
                         text=lambda config: AutoModel.from_config(config.text_config),
                         vision_attrs=("vision_tower", "multi_modal_projector"))


_FAMILIES = {"qwen2_vl": qwen2_vl_classes, "qwen2_5_vl": qwen2_5_vl_classes, "qwen3_vl": qwen3_vl_classes,
             "llava": llava_classes}


@functools.cache
def part_classes(family: str) -> tuple[type, type]:
    """(vision-only, language-only) classes for a family of `_FAMILIES`, built once."""
    return make_part_classes(_FAMILIES[family]())
