"""Shared test helpers: sample chats, the processor's view of them, and the E -> P -> D split by hand."""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image

from services.models.base import LanguageModel, MultiModalInput, VisionModel
from services.prefill.engine import PrefillEngine, PrefillResult

IMAGE_TOKEN_ID = 151655


def picture(width: int, height: int, seed: int) -> Image.Image:
    """A deterministic noisy picture (flat colours would make every patch alike)."""
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def chat(*images: Image.Image, text: str = "Describe what you see.") -> list[dict]:
    if not images:
        return [{"role": "user", "content": text}]
    content = [{"type": "image", "image": image} for image in images]
    return [{"role": "user", "content": [*content, {"type": "text", "text": text}]}]


CHATS = {
    "text": lambda: chat(text="Write a haiku about the sea."),
    "one_image": lambda: chat(picture(448, 448, seed=1)),
    "two_images": lambda: chat(picture(224, 336, seed=2), picture(448, 280, seed=3)),
}


def processor_inputs(processor, messages: list[dict]) -> dict[str, torch.Tensor]:
    return dict(processor.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                              return_dict=True, return_tensors="pt"))


def encode_items(inputs: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Per-image kwargs items, as render hands them to encode: pixel rows split by grid."""
    if "image_grid_thw" not in inputs:
        return []
    grids = inputs["image_grid_thw"]
    pixels = torch.split(inputs["pixel_values"], grids.prod(-1).tolist())
    return [{"pixel_values": p, "image_grid_thw": g} for p, g in zip(pixels, grids, strict=True)]


def placeholder_ranges(token_ids: list[int]) -> list[tuple[int, int]]:
    """(offset, length) of each run of image tokens."""
    ranges: list[tuple[int, int]] = []
    for index, token in enumerate(token_ids):
        if token != IMAGE_TOKEN_ID:
            continue
        if ranges and ranges[-1][0] + ranges[-1][1] == index:
            ranges[-1] = (ranges[-1][0], ranges[-1][1] + 1)
        else:
            ranges.append((index, 1))
    return ranges


def mm_inputs(token_ids: list[int], items: list[dict],
              embeddings: list[torch.Tensor]) -> list[MultiModalInput]:
    ranges = placeholder_ranges(token_ids)
    return [MultiModalInput("image", offset, length, {"image_grid_thw": item["image_grid_thw"]}, embedding)
            for (offset, length), item, embedding in zip(ranges, items, embeddings, strict=True)]


def prefill_chat(vision: VisionModel, engine: PrefillEngine, inputs: dict) -> PrefillResult:
    token_ids = inputs["input_ids"][0].tolist()
    items = encode_items(inputs)
    embeddings = vision.encode(items) if items else []
    return engine.prefill(token_ids, mm_inputs(token_ids, items, embeddings))


def greedy_continue(lm: LanguageModel, result: PrefillResult, max_new_tokens: int) -> list[int]:
    """Decode as another process would: a cache rebuilt from a copy of the KV, one token per step."""
    cache = cache_from_kv(result.kv.clone())
    tokens = [int(result.first_logits.argmax())]
    while len(tokens) < max_new_tokens and tokens[-1] not in lm.eos_token_ids:
        index = result.num_prompt_tokens + len(tokens) - 1  # sequence index of the token fed now
        with torch.no_grad():
            out = lm.model(inputs_embeds=lm.embed(torch.tensor([[tokens[-1]]])), cache=cache, use_cache=True,
                           position_ids=lm.decode_position_ids(torch.tensor([index + result.rope_delta])))
            tokens.append(int(lm.lm_head(out.last_hidden_state[:, -1]).argmax(-1)))
    return tokens


def generate_reference(model, inputs: dict, max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def cache_from_kv(kv: torch.Tensor) -> Any:
    """A DynamicCache holding a copy of `kv` ([num_layers, 2, kv_heads, L, head_dim]) as batch of one."""
    from transformers import DynamicCache

    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"KV must be [num_layers, 2, kv_heads, L, head_dim], got {tuple(kv.shape)}")
    return DynamicCache(ddp_cache_data=[(layer[0][None], layer[1][None]) for layer in kv])
