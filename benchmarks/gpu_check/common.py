"""What the GPU check's sections share: the run's settings, timing on the device, one part file per section."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Run:
    """One section's settings: where it runs, whether it is the CPU dry run, where parts go."""

    device: str
    dry_run: bool
    out: Path

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def save(self, section: str, data: dict[str, Any]) -> Path:
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / f"{section}.json"
        path.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
        return path


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str, repeats: int, warmup: int = 1) -> list[float]:
    """Wall seconds of `fn()` per repeat, the device drained before and after each (after `warmup` calls)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        started = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - started)
    return times


def median(values: list[float]) -> float:
    return statistics.median(values)


def device_info(device: str) -> dict[str, Any]:
    import torch
    import transformers

    info: dict[str, Any] = {"device": device, "torch": torch.__version__, "transformers": transformers.__version__,
                            "python": platform.python_version(), "cpus": os.cpu_count(),
                            "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        free, total = torch.cuda.mem_get_info(torch.device(device))
        info.update(name=props.name, capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                    memory_gib=round(total / 2**30, 1), free_gib=round(free / 2**30, 1), cuda=torch.version.cuda)
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            info["triton"] = None
    else:
        info["name"] = f"CPU ({platform.processor() or platform.machine()}): dry run"
    return info
