"""Is a checkpoint a drop-in for the weights a role serves?  Checked before anything is loaded (no torch).

POST /update_weights names a Hugging Face checkpoint folder (a trainer's `save_pretrained`).  It may replace
the served weights only if it is the same model: the same architecture and every dimension of its config
that shapes a weight, and, where both folders hold safetensors, the same tensor names with the same shapes
(dtypes may differ: a role loads in its own --dtype).  Anything else is refused with a message naming the
first difference, before a byte of weights is read, so nothing changes.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from services.protocol.errors import InvalidRequest

# config keys (top level and inside text_config / vision_config) whose values shape the weights
SHAPE_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings", "depth", "embed_dim",
              "num_heads", "mlp_ratio", "patch_size", "in_channels", "spatial_merge_size", "temporal_patch_size",
              "out_hidden_size", "projector_hidden_act", "image_token_id")
MAX_HEADER_BYTES = 100 << 20   # a safetensors header larger than this is not a checkpoint we read


def _refuse(message: str) -> InvalidRequest:
    return InvalidRequest(message, code="invalid_checkpoint")


def read_config(folder: Path) -> dict[str, Any]:
    try:
        config = json.loads((folder / "config.json").read_text())
    except FileNotFoundError:
        raise _refuse(f"{folder}: no config.json (not a Hugging Face checkpoint folder)") from None
    except (OSError, ValueError) as exc:
        raise _refuse(f"{folder}/config.json: unreadable ({exc})") from None
    if not isinstance(config, dict):
        raise _refuse(f"{folder}/config.json: not a JSON object")
    return config


def shape_config(config: dict[str, Any]) -> dict[str, Any]:
    """The parts of a config that shape the weights (architectures, and SHAPE_KEYS at each level)."""
    out: dict[str, Any] = {"architectures": config.get("architectures")}
    for level in ("", "text_config", "vision_config"):
        source = config.get(level) if level else config
        if isinstance(source, dict):
            out.update({f"{level}.{key}" if level else key: source[key] for key in SHAPE_KEYS if key in source})
    return out


def tensor_shapes(folder: Path) -> dict[str, tuple[int, ...]] | None:
    """{tensor name: shape} from the folder's safetensors headers; None when it holds no safetensors."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with file.open("rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise _refuse(f"{file}: truncated safetensors file")
            (size,) = struct.unpack("<Q", raw)
            if size > MAX_HEADER_BYTES:
                raise _refuse(f"{file}: safetensors header of {size} bytes")
            try:
                header = json.loads(f.read(size))
            except ValueError as exc:
                raise _refuse(f"{file}: bad safetensors header ({exc})") from None
        shapes.update({name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"})
    return shapes


def check_checkpoint(path: str, served: Path) -> Path:
    """The folder `path` names, checked against `served` (the folder the role's weights came from)."""
    folder = Path(path).expanduser()
    if not path or not folder.is_dir():
        raise _refuse(f"weights path {path!r} is not a folder on this instance")
    new, old = shape_config(read_config(folder)), shape_config(read_config(served))
    for key in sorted(set(new) | set(old)):
        if new.get(key) != old.get(key):
            raise _refuse(f"{folder}: config {key} is {new.get(key)!r}, the served model's is {old.get(key)!r} "
                          "(a weight update must keep the architecture)")
    new_shapes, old_shapes = tensor_shapes(folder), tensor_shapes(served)
    if new_shapes is None:
        raise _refuse(f"{folder}: no *.safetensors file (save the checkpoint with save_pretrained)")
    if old_shapes is not None:
        _same_tensors(folder, new_shapes, old_shapes)
    return folder


def _same_tensors(folder: Path, new: dict[str, tuple[int, ...]], old: dict[str, tuple[int, ...]]) -> None:
    missing, extra = sorted(set(old) - set(new)), sorted(set(new) - set(old))
    if missing or extra:
        raise _refuse(f"{folder}: tensors differ from the served model's ({len(missing)} missing, e.g. "
                      f"{missing[:3]}; {len(extra)} unknown, e.g. {extra[:3]})")
    for name in sorted(old):
        if new[name] != old[name]:
            raise _refuse(f"{folder}: tensor {name} has shape {list(new[name])}, the served model's is "
                          f"{list(old[name])}")
