"""Hugging Face classes that hold only one part of a Qwen-VL checkpoint.

Each part class keeps the module paths of the full `...ForConditionalGeneration`
(`model.visual.*`, `model.language_model.*`, `lm_head`) so that `from_pretrained`
loads it from an unmodified checkpoint: the other part's keys are declared
ignorable, weight tying (`lm_head` <- `embed_tokens` when tie_word_embeddings)
still applies, and transformers' own rename rules for older checkpoint layouts
(`visual.*`, `model.layers.*`) are registered for the part class names too,
because transformers looks those rules up by class name.

Imports transformers at module level: import this module lazily.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from torch import nn
from transformers.conversion_mapping import (
    get_checkpoint_conversion_mapping,
    register_checkpoint_conversion_mapping,
)


@dataclass(frozen=True)
class FamilyClasses:
    """The transformers classes of one Qwen-VL family."""

    full: type        # XForConditionalGeneration
    base: type        # XModel (visual + language_model)
    pretrained: type  # XPreTrainedModel
    vision: type      # the vision tower
    text: type        # the text decoder stack


def make_part_classes(family: FamilyClasses) -> tuple[type, type]:
    """(vision-only class, language-only class) for a family, loadable with from_pretrained."""
    prefix = family.full.__name__.removesuffix("ForConditionalGeneration")

    def vision_base_init(self, config):
        family.pretrained.__init__(self, config)
        self.visual = family.vision._from_config(config.vision_config)
        self.post_init()

    def vision_full_init(self, config):
        family.pretrained.__init__(self, config)
        self.model = vision_base(config)
        self.post_init()

    def text_base_init(self, config):
        family.pretrained.__init__(self, config)
        self.language_model = family.text._from_config(config.text_config)
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
        "_keys_to_ignore_on_load_unexpected": [r"^model\.visual\."],
    })
    _inherit_renames(family.full.__name__, (vision_full, text_full))
    return vision_full, text_full


def _inherit_renames(full_name: str, classes: tuple[type, ...]) -> None:
    for cls in classes:
        # a fresh copy per class: registered transforms get scoped to their model
        renames = get_checkpoint_conversion_mapping(full_name)
        if renames is not None:
            register_checkpoint_conversion_mapping(cls.__name__, renames, overwrite=True)


def qwen2_vl_classes() -> FamilyClasses:
    from transformers.models.qwen2_vl import modeling_qwen2_vl as m

    return FamilyClasses(m.Qwen2VLForConditionalGeneration, m.Qwen2VLModel, m.Qwen2VLPreTrainedModel,
                         m.Qwen2VisionTransformerPretrainedModel, m.Qwen2VLTextModel)


def qwen2_5_vl_classes() -> FamilyClasses:
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m

    return FamilyClasses(m.Qwen2_5_VLForConditionalGeneration, m.Qwen2_5_VLModel, m.Qwen2_5_VLPreTrainedModel,
                         m.Qwen2_5_VisionTransformerPretrainedModel, m.Qwen2_5_VLTextModel)


_FAMILIES = {"qwen2_vl": qwen2_vl_classes, "qwen2_5_vl": qwen2_5_vl_classes}


@functools.cache
def part_classes(family: str) -> tuple[type, type]:
    """(vision-only, language-only) classes for "qwen2_vl" or "qwen2_5_vl", built once."""
    return make_part_classes(_FAMILIES[family]())
