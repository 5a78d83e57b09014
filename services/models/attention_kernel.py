"""Prefill's causal attention on AVX-512 for the short spans where torch's CPU SDPA is slow.

services/kernels/prefill_attention.c computes one prompt chunk's attention: row i (prompt position
past + i) over keys 0 .. past + i, grouped-query heads read their kv head, float32 throughout, the
exp by a polynomial accurate to float32 rounding.  `python -m benchmarks.prefill_kernels` times it against
`F.scaled_dot_product_attention(..., is_causal=True, enable_gqa=True)` at the medium demo model's shape (16
query heads over 4 kv heads of 64, 2 threads); on this project's AMD box it took 0.44-0.51x SDPA's time at
117-512 keys, 0.75-0.79x at 1,024 and more than SDPA at 4,096 (docs/benchmarks.md),
so the kernel takes spans of up to MAX_KEYS keys and torch's flash attention (whose blocking wins on
long spans) the rest.  Results agree with SDPA to ~2e-7 relative (tests/services/prefill/
test_attention_kernel.py, with a wrong-mask control; the prefill tests still compare logits at 1e-4 and
require the same greedy tokens).  Built at install (AVX-512 only); on a CPU without AVX-512 every span
goes to SDPA.
"""

from __future__ import annotations

import ctypes
import logging
from typing import TYPE_CHECKING, Any

from services import kernels

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

MAX_KEYS = 1024
MAX_DIM = 256
_LIB: list[Any] = []
_ERROR: list[str] = []


def load() -> str:
    """Load the kernel once; returns '' or why it is off (every span then goes to SDPA)."""
    if _LIB or _ERROR:
        return _ERROR[0] if _ERROR else ""
    try:
        lib = kernels.library("prefill_attention")
    except OSError as exc:
        _ERROR.append(str(exc))
        logger.warning("prefill attention kernel off, torch's SDPA for every span: %s", exc)
        return _ERROR[0]
    p, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.epd_prefill_attention.argtypes = [p, i64, i64, p, i64, i64, p, i64, i64, p, i64, i64, i, i, i, i, i,
                                          ctypes.c_float, i]
    lib.epd_prefill_attention.restype = i
    _LIB.append(lib)
    logger.info("prefill attention: AVX-512 kernel for spans of up to %d keys, torch's SDPA beyond", MAX_KEYS)
    return ""


def applies(q: torch.Tensor, k: torch.Tensor, past: int) -> bool:
    import torch

    heads, _, dim = q.shape
    return (bool(_LIB) and q.dtype == torch.float32 and k.dtype == torch.float32 and q.device.type == "cpu"
            and past + q.shape[1] <= MAX_KEYS and dim % 16 == 0 and dim <= MAX_DIM and heads % k.shape[0] == 0
            and q.stride(-1) == 1 and k.stride(-1) == 1)


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, past: int,
        scale: float | None) -> bool:
    """q [Hq, n, D], k/v [Hkv, past + n, D], out [n, Hq, D] (each a view with contiguous rows): out = causal
    attention of the n rows at positions past .. past + n - 1.  False (nothing written) where the kernel
    does not apply; the caller then runs SDPA.  (A vision tower's full attention stays on SDPA: at 256
    patches this kernel's loop was no faster than SDPA's, which wastes no triangle there.)"""
    import torch

    if not applies(q, k, past) or v.dtype != torch.float32 or v.stride(-1) != 1 or out.stride(-1) != 1:
        return False
    heads, rows, dim = q.shape
    kv_heads = k.shape[0]
    if k.shape[1] < past + rows or v.shape[1] < past + rows:
        raise ValueError(f"attention over {past + rows} keys given {k.shape[1]} keys / {v.shape[1]} values")
    status = _LIB[0].epd_prefill_attention(
        q.data_ptr(), q.stride(1), q.stride(0), k.data_ptr(), k.stride(1), k.stride(0),
        v.data_ptr(), v.stride(1), v.stride(0), out.data_ptr(), out.stride(0), out.stride(1),
        rows, heads, kv_heads, dim, past, dim ** -0.5 if scale is None else scale, torch.get_num_threads())
    return status == 0
