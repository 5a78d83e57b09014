"""RoPE in one C pass for prefill's and encode's forwards, the same floats as transformers' five ops.

Why: transformers applies rotate-half RoPE as `(q * cos) + (rotate_half(q) * sin)` for q and for k: a
cat, a neg, two muls and an add each, ten tensor ops per attention layer, every one a pass over the
queries or keys and (on two threads) an OpenMP fork/join.  On the medium demo model's vision tower
(256 patches, 8 heads of 64) those ops were ~4 ms of a ~44 ms encode; on a 200-token prefill ~2 ms.
services/kernels/rope.c does the same arithmetic in one pass per tensor, compiled without
fused multiply-adds, so every output float is bit-identical to transformers' (checked by
tests/services/models/test_fused_rope.py).

How it is reached: the attention modules of the Qwen-VL families (text and vision) and Llama look up
`apply_rotary_pos_emb` / `apply_rotary_pos_emb_vision` in their modeling module's globals at every
call.  `install()` replaces those names once with dispatchers that run the kernel only inside
`active()`, a per-thread switch that the prefill engine's packed forward and the encode engine's
vision forward turn on; every other call (a test's reference model, `generate`, any thread that did
not ask) runs transformers' own function, so a reference computed in the same process stays
transformers' arithmetic.  Tensors the kernel does not take (not float32, a last dim that is not
contiguous or odd, batch > 1) go to transformers' function too.

`--linear-kernel default` (plain transformers layers) leaves it off as well.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from services import kernels

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch

# the modeling modules whose attention forwards call these two functions by global name
TEXT_MODULES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llama", "qwen2")
VISION_MODULES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
_STATE = threading.local()
_LIB: list[Any] = []
_INSTALLED: dict[str, tuple[Callable[..., Any], Callable[..., Any] | None]] = {}
_LOCK = threading.Lock()


def library() -> Any:
    """The loaded kernel; raises OSError (KernelUnavailable) where none runs here."""
    if not _LIB:
        lib = kernels.library("rope")
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.epd_rope.argtypes = [p, i64, i64, p, p, i64, p, i64, i64, i64, ctypes.c_int]
        lib.epd_rope.restype = None
        _LIB.append(lib)
    return _LIB[0]


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (any token/head strides, rows contiguous), cos/sin [T, D] (rows contiguous) ->
    x * cos + rotate_half(x) * sin as a new contiguous [T, H, D], transformers' floats."""
    import torch

    tokens, heads, dim = x.shape
    out = torch.empty(tokens, heads, dim, dtype=torch.float32)
    library().epd_rope(x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(), cos.stride(0),
                       out.data_ptr(), tokens, heads, dim, torch.get_num_threads())
    return out


def _takes(x: torch.Tensor, cos: torch.Tensor) -> bool:
    import torch

    return (x.dtype == torch.float32 and cos.dtype == torch.float32 and x.device.type == "cpu"
            and x.shape[-1] % 2 == 0 and x.stride(-1) == 1 and cos.stride(-1) == 1 and x.shape[-1] == cos.shape[-1])


def _text(original: Callable[..., Any]) -> Callable[..., Any]:
    def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        # q/k [1, H, T, D], cos/sin [1, T, D] (the heads' axis is the one transformers unsqueezes)
        if (not getattr(_STATE, "on", False) or unsqueeze_dim != 1 or q.dim() != 4 or q.shape[0] != 1
                or cos.dim() != 3 or cos.shape[0] != 1 or cos.shape[1] != q.shape[2] or sin.stride() != cos.stride()
                or not _takes(q, cos) or not _takes(k, cos)):
            return original(q, k, cos, sin, unsqueeze_dim)
        c, s = cos[0], sin[0]
        q_out = rope(q[0].transpose(0, 1), c, s).transpose(0, 1)[None]
        k_out = rope(k[0].transpose(0, 1), c, s).transpose(0, 1)[None]
        return q_out, k_out

    return apply_rotary_pos_emb


def _vision(original: Callable[..., Any]) -> Callable[..., Any]:
    def apply_rotary_pos_emb_vision(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                                    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q/k [T, H, D], cos/sin [T, D]
        if (not getattr(_STATE, "on", False) or q.dim() != 3 or cos.dim() != 2 or cos.shape[0] != q.shape[0]
                or sin.stride() != cos.stride() or not _takes(q, cos) or not _takes(k, cos)):
            return original(q, k, cos, sin)
        return rope(q, cos, sin), rope(k, cos, sin)

    return apply_rotary_pos_emb_vision


def install() -> str:
    """Point the families' modeling modules at the dispatchers (idempotent); returns why not, or ''."""
    with _LOCK:
        if _INSTALLED:
            return ""
        try:
            library()
        except OSError as exc:
            logger.warning("fused RoPE off: %s", exc)
            return str(exc)
        for name in TEXT_MODULES:
            try:
                module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
            except ImportError:
                continue
            text = getattr(module, "apply_rotary_pos_emb", None)
            vision = getattr(module, "apply_rotary_pos_emb_vision", None) if name in VISION_MODULES else None
            if text is None:
                continue
            _INSTALLED[name] = (text, vision)
            module.apply_rotary_pos_emb = _text(text)
            if vision is not None:
                module.apply_rotary_pos_emb_vision = _vision(vision)
        return ""


def installed() -> bool:
    return bool(_INSTALLED)


@contextmanager
def active(on: bool = True) -> Iterator[None]:
    """Let this thread's forwards inside the block use the kernel (where `install()` succeeded)."""
    previous = getattr(_STATE, "on", False)
    _STATE.on = on and bool(_INSTALLED)
    try:
        yield
    finally:
        _STATE.on = previous
