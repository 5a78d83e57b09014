"""The GPU memory budget of the roles on one GPU (--gpu-memory-fraction): decode's KV pool is what is left of it.

All epd roles on a GPU share `fraction x total` bytes of it.  Encode and prefill take what they load and allocate
at start-up (weights, prefill's KV pool and prefix cache, their CUDA contexts); decode starts last (`epd serve`
orders it: services/runtime/launch.py `start_order`) and sizes its KV block pool from what the device reports then:

    pool = fraction x total - used - reserve

`used` = total - free as `torch.cuda.mem_get_info` reports it after decode loaded its weights: every process on
the GPU, this one included.  `reserve` is what is allocated later, outside what `used` saw:
- decode's own step workspace (`step_workspace`): the CUDA graphs' activations, logits and argmax for the largest
  batch bucket, the flex mask's per-block tables, plus a fixed 256 MiB for cuBLAS and Triton;
- the shm connector's CUDA IPC entries: encode's EC store and prefill's KV store keep every tensor they hand out
  by IPC handle in their own GPU memory, up to --ec-capacity-mb / --kv-capacity-mb each (`ipc_reserve`; only
  for a connector that is shm, the one-host path).
The pool's block count is then capped and rounded (`pool_blocks`): flex attention's kernels address one layer's
pool of one KV head with 32-bit offsets, so a head's run of tokens x head_dim stays under 2^31 elements (a bound
only the tiny demo models reach); and the count keeps its top five bits only (at most 1/16 less), so the same
budget gives the same pool from one start to the next, a shape Inductor's on-disk cache then compiles once.
Peers' forward activations (a prefill of --max-num-batched-tokens, an encode batch) come out of the 1 - fraction
left over (0.1 by default: 8 GiB of an 80 GiB H100).  A pool that would be smaller than one request at
max_model_len is refused at start with the figures (`decode_pool_bytes`), never an out-of-memory mid-request.
Pure arithmetic: tests/services/test_gpu_budget.py checks it with exact figures, no GPU needed.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20
FIXED_WORKSPACE = 256 * MIB      # cuBLAS workspaces, Triton and Inductor buffers, the CUDA graph pool's slack


@dataclass(frozen=True)
class Budget:
    """What the pool size came from (logged at start-up; every figure in bytes)."""

    total: int
    free: int
    fraction: float
    reserve: int
    pool: int

    @property
    def used(self) -> int:
        return self.total - self.free

    def line(self) -> str:
        g = 1 << 30
        return (f"GPU budget {self.fraction:g} x {self.total / g:.1f} GiB: {self.used / g:.2f} GiB in use on the "
                f"device, {self.reserve / g:.2f} GiB reserved, KV pool {self.pool / g:.2f} GiB")


def step_workspace(rows: int, hidden: int, intermediate: int, vocab: int, itemsize: int, pool_blocks: int) -> int:
    """Bytes a decode step of `rows` rows allocates beside the pool: logits (model dtype) and their argmax, a
    residual stream and its temporaries (norms, q/k/v/o, the MLP's three), the mask's two per-block int32 tables."""
    logits = rows * vocab * itemsize + rows * 8
    activations = rows * (8 * hidden + 3 * intermediate) * itemsize
    mask = 2 * 4 * (pool_blocks + 2)
    return logits + 2 * activations + mask + FIXED_WORKSPACE


def ipc_reserve(ec_connector: str, kv_connector: str, ec_capacity_mb: int, kv_capacity_mb: int) -> int:
    """GPU bytes the stores of encode (EC) and prefill (KV) may keep for IPC consumers (shm connectors only)."""
    return (ec_capacity_mb * MIB if ec_connector == "shm" else 0) + (kv_capacity_mb * MIB if kv_connector == "shm"
                                                                    else 0)


def decode_pool_bytes(total: int, free: int, fraction: float, reserve: int, min_pool: int) -> Budget:
    """The budget's KV pool; ValueError when it is smaller than `min_pool` (one request at max_model_len)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {fraction}")
    if not 0 <= free <= total:
        raise ValueError(f"the device reports {free} bytes free of {total}")
    pool = int(fraction * total) - (total - free) - reserve
    budget = Budget(total, free, fraction, reserve, max(pool, 0))
    if pool < min_pool:
        raise ValueError(f"{budget.line()}: too small for one request of max_model_len ({min_pool / MIB:.0f} MiB); "
                         "raise --gpu-memory-fraction, lower --max-model-len, --decode-slots or the shm stores' "
                         "capacities, or give decode a GPU of its own")
    return budget


INT32_ELEMENTS = (1 << 31) - 1


def pool_blocks(pool_bytes: int, block_bytes: int, block_size: int, kv_heads: int, head_dim: int) -> int:
    """Blocks of a CUDA pool of `pool_bytes`: capped for flex's 32-bit offsets (its scratch block included), then
    rounded down to the top five bits of the count (module docstring)."""
    blocks = min(pool_bytes // block_bytes, INT32_ELEMENTS // (kv_heads * head_dim * block_size) - 1)
    if blocks < 1:
        return 0
    granule = 1 << max(0, blocks.bit_length() - 5)
    return blocks // granule * granule
