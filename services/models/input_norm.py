"""Normalise raw uint8 pixels at the encoder, exactly as vLLM's `FusedMMInputNorm` does.

vLLM's render (and epd's, for the Qwen-VL families) sends `pixel_values` as raw uint8 (4x
smaller than float32); the vision tower normalises them on its device.  The float32 form
(already normalised by an HF processor, or by vLLM with `--no-mm-device-do-normalize`) is still
accepted: the dtype tells them apart, so nothing is normalised twice.

The arithmetic is vLLM's `forward_native`, in float32: per channel `x * w + b` with
`w = rescale_factor / std` and `b = -mean / std` (both float32 tensors), the patch row viewed as
[C, T*P*P].  Same formula, same order, same dtype: the same floats as vLLM's encoder gets.
Settings come from the checkpoint's preprocessor config (`do_rescale`, `rescale_factor`,
`do_normalize`, `image_mean`, `image_std`), resolved as vLLM's `_load_norm_params` does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

CHANNELS = 3


@dataclass(frozen=True)
class NormParams:
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    rescale_factor: float

    @classmethod
    def from_config(cls, config: dict) -> NormParams:
        has_params = "image_mean" in config and "image_std" in config
        do_normalize = bool(config.get("do_normalize", has_params))
        do_rescale = bool(config.get("do_rescale", has_params))
        rescale = float(config.get("rescale_factor", 1 / 255)) if do_rescale else 1.0
        mean = config.get("image_mean") if do_normalize else [0.0] * CHANNELS
        std = config.get("image_std") if do_normalize else [1.0] * CHANNELS
        if mean is None or std is None or len(mean) != len(std):
            raise ValueError(f"preprocessor config has unusable image_mean / image_std: {mean} / {std}")
        return cls(tuple(float(v) for v in mean), tuple(float(v) for v in std), rescale)

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> NormParams:
        file = Path(path) / "preprocessor_config.json"
        config = json.loads(file.read_text()) if file.is_file() else {}
        return cls.from_config(config.get("image_processor", config))


def normalize_pixels(pixels: torch.Tensor, params: NormParams) -> torch.Tensor:
    """uint8 [patches, C*L] -> float32 normalised; any other dtype is returned as it is (already normalised)."""
    import torch

    if pixels.dtype != torch.uint8:
        return pixels
    if pixels.dim() != 2 or pixels.shape[1] % len(params.image_mean):
        raise ValueError(f"uint8 pixel_values must be [patches, {len(params.image_mean)}*L], "
                         f"got {tuple(pixels.shape)}")
    channels = len(params.image_mean)
    mean = torch.tensor(params.image_mean, dtype=torch.float32)
    std = torch.tensor(params.image_std, dtype=torch.float32)
    weight, bias = params.rescale_factor / std, -mean / std
    patches, size = pixels.shape
    out = pixels.to(torch.float32)  # exact; then x * w + b in place: the same two roundings, one 4-byte buffer
    x = out.view(patches, channels, size // channels)  # (x * w + b allocated two: 10 ms vs 3 ms at 1024x768)
    x.mul_(weight.view(1, channels, 1)).add_(bias.view(1, channels, 1))
    return out
