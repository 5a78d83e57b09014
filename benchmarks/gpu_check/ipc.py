"""A CUDA tensor read by another process through the shm connector's IPC handle vs a device-to-device copy.

The producer (this process) puts a bfloat16 CUDA tensor into an shm store, which hands it over by CUDA IPC handle
(services/connectors/cuda_ipc.py); a consumer process opens it (`store.view`: lease, IPC open, no copy) and copies
it into memory of its own, as decode copies a prefilled KV into its blocks.  Baseline: the same copy within one
process (`dst.copy_(src)`).  Figure: consumer copy GB/s over the baseline's, at the largest size (target >= 0.8:
the IPC path adds a mapping, not a slower copy).  The first open is reported apart (the IPC open itself).
Dry run: a CPU tensor through the pool's bytes and a memcpy (no CUDA here), the same code path otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from benchmarks.gpu_check.common import Run, median, sync, timed

SIZES_MB = (64, 256)
REPEATS = 20


def consumer(handle_json: str, device: str, repeats: int) -> dict[str, float]:
    """(In the consumer process.) Open the entry, then time copies out of it into this process's memory."""
    import torch

    from services.connectors import StoreConfig, create_store

    store = create_store(StoreConfig("shm", "kv", f"gpuchkc{os.getpid()}", preallocate=False))
    handle = json.loads(handle_json)
    sync(device)
    started = time.perf_counter()
    with store.view(handle) as views:
        tensor = views["kv"]
        sync(device)
        opened = time.perf_counter() - started
        dst = torch.empty_like(tensor)
        copies = timed(lambda: dst.copy_(tensor), device, repeats)
        checksum = float(dst.float().sum())
    store.close()
    return {"open_s": opened, "copy_s": median(copies), "checksum": checksum}


def _measure(run: Run, size_mb: int, repeats: int) -> dict[str, Any]:
    import torch

    from services.connectors import StoreConfig, create_store

    numel = (size_mb << 20) // 2
    src = torch.randn(numel, device=run.device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    d2d = median(timed(lambda: dst.copy_(src), run.device, repeats))
    store = create_store(StoreConfig("shm", "kv", f"gpuchk{os.getpid()}", capacity_bytes=(size_mb + 8) << 20))
    try:
        handle = store.put("bench", {"kv": src})
        done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "ipc-consumer", json.dumps(handle),
                               "--device", run.device, "--repeats", str(repeats)],
                              capture_output=True, text=True, timeout=120, check=True)
        got = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        store.close()
    nbytes = numel * 2
    return {"size_mb": size_mb, "by_handle": bool(handle["cuda"]), "d2d_gbs": nbytes / d2d / 1e9,
            "ipc_copy_gbs": nbytes / got["copy_s"] / 1e9, "ratio": d2d / got["copy_s"],
            "first_open_ms": got["open_s"] * 1e3, "checksum_ok": abs(got["checksum"] - float(src.float().sum())) < 1e-3
            * max(1.0, abs(float(src.float().sum())))}


def run(run: Run) -> dict[str, Any]:
    sizes, repeats = ((4,), 3) if run.dry_run else (SIZES_MB, REPEATS)
    rows = [_measure(run, size, repeats) for size in sizes]
    return {"path": "cuda-ipc" if run.cuda else "host shm pool (dry run: no CUDA)", "rows": rows,
            "ratio": rows[-1]["ratio"], "size_mb": rows[-1]["size_mb"]}
