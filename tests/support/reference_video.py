"""The single-process reference for prompts with videos: Hugging Face `generate` fed the processed video.

transformers' video processors need torchvision, which cannot be installed here, so the reference takes
each video's processed frames (pixel_values_videos, video_grid_thw and the sampling metadata) from epd's
video processor, normalised as vLLM normalises them (`services.models.input_norm`; the pixels themselves
are checked against a real vLLM by tests/interop), and builds everything else with transformers' own code:
the chat template, the prompt expansion (the processor's `replace_video_token`, Qwen3-VL's timestamps
included), tokenization, `mm_token_type_ids`, Qwen2.5-VL's `second_per_grid_ts`, and `generate`.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from PIL import Image


def video_processor(model_path: str | Path) -> Any:
    """epd's video processing for the checkpoint, with the default render limits."""
    from services.models.registry import adapter_for
    from services.render.limits import RenderLimits
    from services.render.serving import _video_processor

    spec = adapter_for(model_path).render_spec(model_path)
    processor = _video_processor(model_path, spec, RenderLimits())
    assert processor is not None, f"{model_path} has no video processing"
    return processor


def greedy_parts(reference: Any, parts: list[tuple[str, Any]], max_new_tokens: int) -> list[int]:
    """Greedy ids for one user turn of ("image", PIL image) | ("video", bytes) | ("text", str) parts."""
    import torch

    processor, model_path = reference.processor, reference.model_path
    content = [{"type": kind} if kind != "text" else {"type": "text", "text": value} for kind, value in parts]
    prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                           tokenize=False)
    images = [_image_arrays(processor, value) for kind, value in parts if kind == "image"]
    videos = [video_processor(model_path).process(value) for kind, value in parts if kind == "video"]
    prompt = _expand(processor, prompt, "image", images)
    prompt = _expand(processor, prompt, "video", videos)
    inputs = processor.tokenizer([prompt], return_tensors="pt")
    _add_media(inputs, processor, images, videos, model_path)
    inputs = inputs.to(reference.device)
    with torch.no_grad():
        out = reference.model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def _image_arrays(processor: Any, image: Image.Image) -> Any:
    """The image's pixels as vLLM (and epd) feed the tower (tests/support/reference.py explains why)."""
    from services.render.qwen_pixels import QwenPixelSettings, qwen_pixels

    settings = QwenPixelSettings.from_processor(processor.image_processor)
    return SimpleNamespace(arrays=qwen_pixels(image, settings), info={})


def _expand(processor: Any, prompt: str, modality: str, items: list[Any]) -> str:
    """transformers' own placeholder expansion, item by item (the processor's replace_image_token /
    replace_video_token, Qwen3-VL's timestamps included)."""
    import torch
    from transformers.video_utils import VideoMetadata

    token = processor.image_token if modality == "image" else processor.video_token
    merge = processor.image_processor.merge_size
    processor.video_processor = SimpleNamespace(merge_size=merge, temporal_patch_size=2)  # what replace_ reads
    grids = torch.stack([torch.from_numpy(i.arrays[f"{modality}_grid_thw"]).reshape(3) for i in items]) \
        if items else None
    pieces = prompt.split(token)
    assert len(pieces) == len(items) + 1, f"one {token} per {modality} in the templated prompt"
    out = pieces[0]
    for index, piece in enumerate(pieces[1:]):
        if modality == "image":
            expanded = processor.replace_image_token({"image_grid_thw": grids}, index)
        else:
            metadata = [VideoMetadata(**i.info["metadata"]) for i in items]
            expanded = processor.replace_video_token({"video_grid_thw": grids, "video_metadata": metadata}, index)
        out += expanded.replace(token, "<|placeholder|>") + piece
    processor.video_processor = None
    return out.replace("<|placeholder|>", token)


def _add_media(inputs: Any, processor: Any, images: list[Any], videos: list[Any], model_path: str | Path) -> None:
    import torch

    from services.models.input_norm import NormParams, normalize_pixels

    ids = inputs["input_ids"]
    types = torch.zeros_like(ids)
    types[ids == processor.image_token_id] = 1
    types[ids == processor.video_token_id] = 2
    inputs["mm_token_type_ids"] = types
    params = NormParams.from_checkpoint(model_path)
    for modality, items, key in (("image", images, "pixel_values"), ("video", videos, "pixel_values_videos")):
        if items:
            inputs[key] = torch.cat([normalize_pixels(torch.from_numpy(i.arrays[key]), params) for i in items])
            inputs[f"{modality}_grid_thw"] = torch.stack([
                torch.from_numpy(i.arrays[f"{modality}_grid_thw"]).reshape(3) for i in items])
    if videos and "second_per_grid_ts" in videos[0].arrays:
        inputs["second_per_grid_ts"] = torch.tensor([float(v.arrays["second_per_grid_ts"]) for v in videos])


def image(width: int, height: int, seed: int) -> Image.Image:
    from tests.support.images import noise_image

    return noise_image(width, height, seed)
