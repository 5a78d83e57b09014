"""Load the best variant of a kernel this CPU can run, from the libraries built at install.

`load(name)` returns the kernel's `Loaded` (the ctypes library and the variant that runs, or why none
does); `library(name)` the library itself or `KernelUnavailable` (an OSError: callers' torch fallbacks
catch it).  The first call per kernel decides, later calls return the same answer.  What may be loaded:
only the libraries setup.py built into this package folder (services/kernels/_<kernel>_<variant>.*.so),
never a file from a cache or any other folder; a library file or folder that a user other than its owner
may write (group- or world-writable), or that belongs to neither root nor this process's user, is refused.

Variant choice: the first of `spec.KERNELS[name].variants` (best first) whose CPU features are all in
`cpu.features()` and whose library exists here.  States other than a variant name:
- "off": EPD_KERNELS_OFF (--kernels-off) names it (or its family: "panel" is panel and panel_bf16);
- "unsupported": no variant's features are on this CPU (after EPD_CPU_FEATURES_OFF);
- "not_built": the CPU could run a variant but no library of it is installed (a broken or partial build);
- "refused": the file failed the ownership and mode check above; "failed": the dynamic loader refused it.
Every decision sets `epd_kernel_info{kernel,variant}` to 1 and is logged once; `report(names)` decides a
role's kernels at start-up and logs them on one line.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.machinery
import logging
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import Gauge

from services.kernels import cpu
from services.kernels.spec import FAMILIES, KERNELS, VARIANTS

logger = logging.getLogger(__name__)

ENV_OFF = "EPD_KERNELS_OFF"
FOLDER = Path(__file__).resolve().parent
INFO = Gauge("epd_kernel_info", "The variant of each native kernel this process runs (1): an instruction set, or "
             "off | unsupported | not_built | refused | failed (torch's path runs instead)", ["kernel", "variant"])
# What each role runs (its start-up report); the shm fence only where the CPU needs one (shm_fence.py).
ROLE_KERNELS = {
    "render": ("resize",),
    "encode": ("panel",),
    "prefill": ("prefill_attention", "panel", "panel_bf16", "head_int8"),   # + its LM head screen
    "decode": ("panel", "panel_bf16", "fused_step", "fused_step_bf16", "head_int8"),
}
RELEVANT = frozenset(feature for variant in VARIANTS.values() for feature in variant.features)
_LOADED: dict[str, Loaded] = {}
_LOCK = threading.Lock()


class KernelUnavailable(OSError):
    """No variant of the kernel runs in this process (the message says why); callers take torch's path."""


@dataclass(frozen=True)
class Loaded:
    kernel: str
    variant: str
    library: ctypes.CDLL | None
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.library is not None


def off_names() -> frozenset[str]:
    """The kernels EPD_KERNELS_OFF names, families expanded."""
    names = {part.strip() for part in os.environ.get(ENV_OFF, "").split(",") if part.strip()}
    return frozenset(member for name in names for member in FAMILIES.get(name, (name,)))


def load(name: str) -> Loaded:
    """The kernel `name` as this process runs it (decided once)."""
    if name not in KERNELS:
        raise ValueError(f"unknown kernel {name!r}; known: {', '.join(sorted(KERNELS))}")
    with _LOCK:
        if name not in _LOADED:
            loaded = _decide(name)
            _LOADED[name] = loaded
            INFO.labels(name, loaded.variant).set(1)
            log = logger.info if loaded.ok or loaded.variant in ("off", "unsupported") else logger.warning
            log("kernel %s: %s%s", name, loaded.variant, f" ({loaded.reason})" if loaded.reason else "")
        return _LOADED[name]


def library(name: str) -> ctypes.CDLL:
    """The loaded library of `name`; raises KernelUnavailable (an OSError) when none runs here."""
    loaded = load(name)
    if loaded.library is None:
        raise KernelUnavailable(f"kernel {name}: {loaded.variant} ({loaded.reason})")
    return loaded.library


def expected(name: str) -> str:
    """The variant this CPU should run (the best whose features it has), "" where none: what tests hold
    `load(name).variant` to, so a missing or broken build fails instead of quietly running torch's path."""
    kernel = KERNELS[name]
    return next((v for v in kernel.variants if cpu.has(_features(v))), "")


def report(role: str) -> str:
    """Decide each of `role`'s kernels now; one log line and the text of it ("panel avx512, resize off, ...")."""
    text = ", ".join(f"{name} {load(name).variant}" for name in ROLE_KERNELS.get(role, ()))
    cpu_text = ",".join(sorted(cpu.features() & RELEVANT)) or "none of the kernels' features"
    logger.info("native kernels: %s (cpu: %s)", text or "none", cpu_text)
    return text


def configure(kernels_off: str, cpu_features_off: str) -> None:
    """A role's --kernels-off / --cpu-features-off, as the environment this process and its children read."""
    os.environ[ENV_OFF], os.environ[cpu.ENV] = kernels_off, cpu_features_off
    reset()


def reset() -> None:
    """Forget every decision (tests that change EPD_CPU_FEATURES_OFF / EPD_KERNELS_OFF between cases)."""
    with _LOCK:
        _LOADED.clear()
        INFO.clear()


def path_of(name: str, variant: str) -> Path | None:
    """The installed library of one variant, if built."""
    base = KERNELS[name].library(variant)
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = FOLDER / f"{base}{suffix}"
        if candidate.is_file():
            return candidate
    return None


def _decide(name: str) -> Loaded:
    if name in off_names():
        return Loaded(name, "off", None, f"{ENV_OFF}")
    kernel = KERNELS[name]
    runnable = [v for v in kernel.variants if cpu.has(_features(v))]
    if not runnable:
        return Loaded(name, "unsupported", None, f"needs one of {', '.join(kernel.variants)}; torch's path runs")
    for variant in runnable:
        path = path_of(name, variant)
        if path is None:
            logger.warning("kernel %s: the %s variant is not installed (rebuild: pip install .)", name, variant)
            continue
        problem = _unsafe(path)
        if problem:
            return Loaded(name, "refused", None, problem)
        try:
            return Loaded(name, variant, _open(kernel.openmp, path))
        except OSError as exc:
            return Loaded(name, "failed", None, str(exc))
    return Loaded(name, "not_built", None, f"no library of {', '.join(runnable)} in {FOLDER}; reinstall epd")


def _features(variant: str) -> tuple[str, ...]:
    return VARIANTS[variant].features


def _unsafe(path: Path) -> str:
    """Why `path` must not be loaded ('' when it may): writable by others, or owned by a stranger."""
    uid = os.geteuid()
    for item in (path, path.parent):
        info = item.stat()
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"{item} is writable by users other than its owner"
        if info.st_uid not in (0, uid):
            return f"{item} belongs to uid {info.st_uid}, neither root nor this process's user"
    return ""


def _open(openmp: bool, path: Path) -> ctypes.CDLL:
    if openmp:   # torch's libgomp first: the library's libgomp.so.1 then binds to it, one OpenMP runtime
        with contextlib.suppress(ImportError):
            import torch  # noqa: F401
    return ctypes.CDLL(str(path))
