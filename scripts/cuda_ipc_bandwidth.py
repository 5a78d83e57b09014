"""CUDA IPC connector vs device-to-device copy: how fast a CUDA tensor reaches another process.

Producer (this process) puts a CUDA tensor into the shm store (which hands it
over by CUDA IPC handle); a consumer process opens the handle and copies the
tensor into its own memory (`store.get`, what prefill/decode do), and also
just maps it (`store.view`).  Baseline: `dst.copy_(src)` on the same device in
one process.  Prints one Markdown table (GB/s, median of the repeats).

    python scripts/cuda_ipc_bandwidth.py [--sizes-mb 16 64 256] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _timed(fn, repeats: int) -> tuple[float, float]:
    """(first call seconds, median seconds of the next `repeats` calls), CUDA-synchronised."""
    import torch

    def once() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    first = once()
    return first, statistics.median(once() for _ in range(repeats))


def consumer(handle_json: str, instance: str, repeats: int) -> None:
    from services.connectors.base import StoreConfig
    from services.connectors.registry import create_store

    store = create_store(StoreConfig("shm", "kv", instance, preallocate=False))
    handle = json.loads(handle_json)

    def view() -> None:
        with store.view(handle) as tensors:
            tensors["kv"].sum()  # touch it: mapping alone proves nothing

    first_get, get = _timed(lambda: store.get(handle), repeats)
    first_view, view_s = _timed(view, repeats)
    print(json.dumps({"first_get_s": first_get, "get_s": get, "first_view_s": first_view, "view_s": view_s}))


def producer(size_mb: int, repeats: int) -> dict[str, float]:
    import torch

    from services.connectors.base import StoreConfig
    from services.connectors.registry import create_store

    numel = size_mb * (1 << 20) // 2
    src = torch.randn(numel, device="cuda", dtype=torch.float32).to(torch.bfloat16)
    dst = torch.empty_like(src)
    _, d2d = _timed(lambda: dst.copy_(src), repeats)
    store = create_store(StoreConfig("shm", "kv", f"bw{os.getpid()}", capacity_bytes=(size_mb + 8) << 20))
    try:
        handle = store.put("bench", {"kv": src})
        out = subprocess.run([sys.executable, __file__, "--consumer", json.dumps(handle), "--repeats", str(repeats)],
                             capture_output=True, text=True, timeout=120, check=True, cwd=ROOT)
        ipc = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        store.close()
    nbytes = numel * 2
    return {"size_mb": size_mb, "d2d_gbs": nbytes / d2d / 1e9, "ipc_get_gbs": nbytes / ipc["get_s"] / 1e9,
            "ipc_first_get_ms": ipc["first_get_s"] * 1e3, "ipc_view_ms": ipc["view_s"] * 1e3}


def table(rows: list[dict[str, float]], device: str) -> str:
    lines = [f"CUDA IPC connector vs device-to-device copy on {device} (bf16, median of repeats)", "",
             "| size | D2D copy (GB/s) | IPC get = open + copy (GB/s) | first IPC get (ms) | IPC view, no copy (ms) |",
             "|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['size_mb']} MiB | {r['d2d_gbs']:.0f} | {r['ipc_get_gbs']:.0f} | "
                     f"{r['ipc_first_get_ms']:.2f} | {r['ipc_view_ms']:.3f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--consumer", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.consumer:
        consumer(args.consumer, f"bwc{os.getpid()}", args.repeats)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    print(table([producer(size, args.repeats) for size in args.sizes_mb], torch.cuda.get_device_name(0)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
