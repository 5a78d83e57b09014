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
  ish` on aarch64) from a tiny C helper compiled on first use with the host's
  C compiler (`cc`) and loaded with ctypes; the library is cached under
  EPD_CACHE_DIR (default ~/.cache/epd), or built in a temporary folder when
  that is not writable.  With no compiler the shm connector refuses to start
  (ConnectorError naming the fix) instead of risking torn reads.

`install("compiled")` forces the compiled fence on any architecture (the
cross-process stress test runs both kinds); `install("auto")` is the default.
Who calls what: shm_layout calls `fence()`; nobody else needs to.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable

from services.connectors.base import ConnectorError

TSO_MACHINES = frozenset({"x86_64", "amd64", "i386", "i486", "i586", "i686"})
_SOURCE = "void epd_shm_fence(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }\n"
_COMPILE_TIMEOUT_S = 60.0


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
    """Choose the fence for this process: `auto` (by architecture) or `compiled` (the C helper)."""
    global _fence, kind
    machine = (machine or platform.machine()).lower()
    if mode == "auto" and machine in TSO_MACHINES:
        _fence, kind = _no_fence, "none (x86 total store order)"
    elif mode in ("auto", "compiled"):
        _fence, kind = _compiled_fence(machine), "compiled"
    else:
        raise ValueError(f"unknown fence mode {mode!r}; supported: auto, compiled")
    return _fence


def _compiled_fence(machine: str) -> Callable[[], None]:
    library = _library_path(machine)
    if not os.path.exists(library):
        compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
        if compiler is None:
            raise ConnectorError(
                f"the shm connector needs a memory fence on {machine} (its CPU may reorder the seqlock's "
                "stores), built from C on first use, and no C compiler (cc) was found: install one (e.g. gcc) "
                "or use the redis connectors (--ec-connector redis --kv-connector redis)")
        try:
            _compile(compiler, library)
        except OSError:  # the cache is not writable: build aside, load, and let the file go
            with tempfile.TemporaryDirectory(prefix="epd-fence-") as folder:
                return _load(_compile(compiler, os.path.join(folder, os.path.basename(library))))
    return _load(library)


def _load(library: str) -> Callable[[], None]:
    function = ctypes.CDLL(library).epd_shm_fence
    function.argtypes, function.restype = [], None
    return function  # type: ignore[no-any-return]


def _library_path(machine: str) -> str:
    root = os.environ.get("EPD_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "epd")
    digest = hashlib.sha256(_SOURCE.encode()).hexdigest()[:12]
    return os.path.join(root, f"shm_fence-{machine}-{digest}.so")


def _compile(compiler: str, target: str) -> str:
    """Build the helper next to `target`, then rename it there (atomic for concurrent starts)."""
    folder = os.path.dirname(target)
    os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as work:
        source = os.path.join(work, "fence.c")
        with open(source, "w") as f:
            f.write(_SOURCE)
        built = os.path.join(work, os.path.basename(target))
        done = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", built, source],
                              capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S)
        if done.returncode != 0:
            raise ConnectorError(f"building the shm memory fence with {compiler} failed: {done.stderr[-500:]}")
        os.replace(built, target)
    return target
