"""Checkpoint folders for weight-update tests: the demo model with other weights, or with another shape."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def other_weights(source: Path, target: Path, seed: int = 1) -> Path:
    """A copy of checkpoint `source` whose weights are all perturbed (same names, shapes and config): what a
    trainer's save_pretrained after a step looks like."""
    import torch
    from safetensors.torch import load_file, save_file

    if (target / "DONE").exists():
        return target
    shutil.copytree(source, target, dirs_exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    for file in sorted(source.glob("*.safetensors")):
        tensors = load_file(str(file))
        changed = {name: (t + 0.05 * torch.randn(t.shape, generator=generator, dtype=torch.float32).to(t.dtype))
                   if t.is_floating_point() else t for name, t in tensors.items()}
        save_file(changed, str(target / file.name), metadata={"format": "pt"})
    (target / "DONE").write_text("ok")
    return target


def other_shape(source: Path, target: Path) -> Path:
    """A copy of `source` whose config says another hidden size (a different architecture's checkpoint)."""
    shutil.copytree(source, target, dirs_exist_ok=True)
    config = json.loads((target / "config.json").read_text())
    text = config.get("text_config", config)
    text["hidden_size"] = text["hidden_size"] * 2
    (target / "config.json").write_text(json.dumps(config))
    return target
