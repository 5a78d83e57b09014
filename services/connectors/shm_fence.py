"""The memory fence the shm seqlock needs between its header and payload accesses, per CPU architecture.

The seqlock (shm_layout) is correct only if other processes observe a writer's
stores in the order the protocol issues them (slot invalidated, then payload,
then slot published) and a reader's loads happen in its program order (slot,
payload, slot again).  Python gives no memory-ordering primitive, so:

- x86-64 (and 32-bit x86) is total-store-order: stores are seen in program
  order and loads are not reordered with other loads.  Every access here is a
  separate call into C (mmap / numpy / torch copies), which the C compiler
  cannot reorder across, so no fence instruction is needed: `fence` is a no-op.
- every other architecture (aarch64, e.g. GH200; ppc64le; riscv64) may reorder
  both.  There `fence` is `__atomic_thread_fence(__ATOMIC_SEQ_CST)` (a `dmb
  ish` on aarch64) from services/kernels/shm_fence.c, built with the other
  kernels when epd is installed (its portable variant builds on every
  architecture) and loaded with ctypes: no compiler is needed at run time.
  Should the library be missing (a broken install) the shm connector refuses to
  start (ConnectorError naming the fix) instead of risking torn reads.

`install("compiled")` forces the built fence on any architecture (the
cross-process stress test runs both kinds); `install("auto")` is the default.
Who calls what: shm_layout calls `fence()`; nobody else needs to.
"""

from __future__ import annotations

import platform
from collections.abc import Callable

from services.connectors.base import ConnectorError

TSO_MACHINES = frozenset({"x86_64", "amd64", "i386", "i486", "i586", "i686"})


def _no_fence() -> None:
    return None


_fence: Callable[[], None] | None = None
kind = ""  # "none (x86 total store order)" or "compiled", once installed


def fence() -> None:
    """Order every memory access before this call before every access after it (as seen by other CPUs)."""
    (_fence or install())()


def ensure() -> str:
    """Install the default fence unless one is installed (raises ConnectorError if none can be); its kind."""
    if _fence is None:
        install()
    return kind


def install(mode: str = "auto", machine: str | None = None) -> Callable[[], None]:
    """Choose the fence for this process: `auto` (by architecture) or `compiled` (the built C fence)."""
    global _fence, kind
    machine = (machine or platform.machine()).lower()
    if mode == "auto" and machine in TSO_MACHINES:
        _fence, kind = _no_fence, "none (x86 total store order)"
    elif mode in ("auto", "compiled"):
        _fence, kind = _built_fence(machine), "compiled"
    else:
        raise ValueError(f"unknown fence mode {mode!r}; supported: auto, compiled")
    return _fence


def _built_fence(machine: str) -> Callable[[], None]:
    from services.kernels import KernelUnavailable, library

    try:
        function = library("shm_fence").epd_shm_fence
    except KernelUnavailable as exc:
        raise ConnectorError(
            f"the shm connector needs a memory fence on {machine} (its CPU may reorder the seqlock's stores), "
            f"built when epd is installed, and it is not loaded here ({exc}): reinstall epd (pip install .) "
            "or use the redis connectors (--ec-connector redis --kv-connector redis)") from exc
    function.argtypes, function.restype = [], None
    return function  # type: ignore[no-any-return]
