"""The one place the decode engine's pool and runner are chosen by device.

CPU: the blocks-major pool and `DecodeRunner` (C kernels, the fused or the eager step: services/decode/runner.py).
CUDA: a heads-major pool and `GpuRunner` (flex paged attention, CUDA graphs: services/decode/gpu_runner.py); the
CPU-only options must be left at auto there (services/models/device_plan.py refuses them in the config; a direct caller
asking for any attention but "auto" or "flex" on CUDA gets a ValueError).  `attention="flex"` runs the CUDA step's
code on CPU too, eagerly and without graphs: the tests and `scripts/gpu_check.sh --dry-run` check its tokens that way.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.decode.block_pool import BlockPool
from services.decode.gpu_runner import GpuRunner
from services.decode.runner import DecodeRunner
from services.models.base import LanguageModel
from services.sampling.sampler import Sampler

FLEX = "flex"


def uses_gpu_step(lm: LanguageModel, attention: str) -> bool:
    """The CUDA step runs this model: on a CUDA device, or asked for by name ("flex")."""
    cuda = str(getattr(lm, "device", None) or "cpu").startswith("cuda")
    if cuda and attention not in ("auto", FLEX):
        raise ValueError(f"decode attention {attention!r} is CPU-only; on CUDA the step uses paged flex attention")
    return cuda or attention == FLEX


def make_pool(lm: LanguageModel, capacity_bytes: int, block_size: int, attention: str) -> BlockPool:
    return BlockPool(lm.layout, capacity_bytes, block_size, device=lm.device or "cpu",
                     heads_major=uses_gpu_step(lm, attention))


def make_runner(lm: LanguageModel, pool: BlockPool, max_rows: int, max_model_len: int, sampler: Sampler,
                attention: str = "auto", serial_rows: int = 0, fused: str = "auto",
                fused_serial_rows: int | None = None, lm_head_screen: str = "auto",
                graph_buckets: Sequence[int] | None = None) -> DecodeRunner | GpuRunner:
    """`graph_buckets`: the CUDA step's graph sizes (default 1, 2, 4, ... up to max_rows; the GPU check picks fewer
    to spend its minutes on requests)."""
    if uses_gpu_step(lm, attention):
        return GpuRunner(lm, pool, max_rows, max_model_len, sampler, graph_buckets)
    return DecodeRunner(lm, pool, max_rows, max_model_len, sampler, serial_rows, fused,
                        fused_serial_rows, lm_head_screen)
