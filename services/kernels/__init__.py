"""epd's native kernels: C sources built once at install into this package, one library per instruction set.

setup.py compiles every (kernel, variant) of `spec.KERNELS` with the build machine's C compiler when epd
is installed (`pip install .`, the wheel, `pip install -e .`); nothing is compiled at run time, so a
machine without a compiler runs the same code as the one that built the wheel.  At run time
`loader.load(name)` picks the best variant the CPU has (services/kernels/cpu.py) and reports it in the
log and in `epd_kernel_info{kernel,variant}`; callers fall back to torch's path where none runs.
Who calls what: each kernel's Python wrapper (services/models/panel_linear.py, services/decode/fused.py,
...) calls `library(name)`; role start-up calls `report(ROLE_KERNELS[role])`.
"""

from __future__ import annotations

from services.kernels.loader import KernelUnavailable, Loaded, library, load, report

__all__ = ["KernelUnavailable", "Loaded", "library", "load", "report"]
