"""Start-up kernel timings kept between starts: what `--linear-kernel auto` measured (services/models/prepack.py,
fused_mlp.py), so a restart, a second instance or a weight update of the same shapes on the same machine swaps at
once instead of timing again.

Why: auto times F.linear against the swapped kernels on the model's own layer shapes, one role at a time on the
machine (timing_lock.py): seconds of a role's start on the medium demo model (benchmarks/startup.py measures a
start with and without them), and each weight version a running role stages was timed again, under the load that
role serves, which makes the timing both slower and less true (benchmarks/weight_update.py --baseline).

A decision is a small JSON file under `$EPD_CACHE_DIR/kernel-choices/` (beside the model cache; ~/.cache/epd by
default), named by a digest of everything the timing depended on:
- what was timed: each layer shape with its rows and bias, the dtype, the kernels tried, the rows timed on one
  thread, the dtype kept for swapped weights;
- where: torch's version, the CPU's model name and flags, the threads the timing runs on, the CPUs the process
  may use;
- with what code: the kernel builds (services/kernels/_*.so) and the Python that times and swaps them.
Not the weights' values: a dense matmul's time does not depend on them, and the outputs' agreement checked at
timing is the kernels' rounding (float32: ~1e-6 relative against the 1e-4 bound).  Delete the folder to time
again (the first start after a machine change times by itself: the key changes).  A file that does not parse,
that another user owns, or whose decision is not one this code makes, is ignored and timed over.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.models.timing_lock import timing_lock

logger = logging.getLogger(__name__)

FOLDER = "kernel-choices"
_CODE = ("prepack.py", "packed_linear.py", "panel_linear.py", "fused_mlp.py", "kernel_choices.py")


def folder() -> Path:
    from services.models.demo import default_cache_dir

    return default_cache_dir() / FOLDER


def decided(kind: str, what: dict[str, Any], measure: Callable[[], dict[str, Any]],
            valid: Callable[[dict[str, Any]], bool]) -> tuple[dict[str, Any], str]:
    """The decision for `what`: kept from an earlier timing (second item: when it was timed), else `measure()`
    run now under the timing lock and kept (second item ""; not kept when the lock's wait ran out and it timed
    beside another process's timing); `valid` vets a kept one."""
    path = folder() / f"{kind}-{_key(kind, what)}.json"
    kept = _read(path, valid)
    if kept is not None:
        return kept
    with timing_lock() as alone:
        kept = _read(path, valid)   # another process of this model timed it while this one waited
        if kept is not None:
            return kept
        decision = measure()
    if alone:   # timed beside another role's timing (the lock's wait ran out): not a decision to keep
        _write(path, {"kind": kind, "what": what, "timed_at": time.strftime("%Y-%m-%d %H:%M:%S"),
                      "decision": decision})
    return decision, ""


def _key(kind: str, what: dict[str, Any]) -> str:
    from services.hostcpu import compute_threads

    where = {**_machine_and_code(), "threads": compute_threads.count(), "cpus": compute_threads.cpus()}
    text = json.dumps({"kind": kind, "what": what, "where": where}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


@functools.lru_cache(maxsize=1)
def _machine_and_code() -> dict[str, Any]:
    import torch

    cpu: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        for line in info:
            name, _, value = line.partition(":")
            if name.strip() in ("model name", "flags"):
                cpu.setdefault(name.strip(), value.strip())
    code = hashlib.sha256()
    here = Path(__file__).parent
    for path in [*(here / name for name in _CODE), *sorted((here.parent / "kernels").glob("_*.so"))]:
        with contextlib.suppress(OSError):
            code.update(path.name.encode() + b"\0" + path.read_bytes())
    return {"torch": torch.__version__, "cpu": cpu or platform.processor(), "code": code.hexdigest()}


def _read(path: Path, valid: Callable[[dict[str, Any]], bool]) -> tuple[dict[str, Any], str] | None:
    try:
        with open(path, "rb") as handle:
            if os.fstat(handle.fileno()).st_uid != os.getuid():
                logger.warning("kernel choice %s belongs to another user: timing again", path)
                return None
            kept = json.loads(handle.read())
        decision, when = kept["decision"], str(kept["timed_at"])
        if isinstance(decision, dict) and valid(decision):
            return decision, when
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("kernel choice %s unreadable (%s): timing again", path, exc)
        return None
    logger.warning("kernel choice %s holds no decision this version makes: timing again", path)
    return None


def _write(path: Path, record: dict[str, Any]) -> None:
    """Atomically (a reader sees the whole file or none); a folder that cannot be written only costs the next
    start its timing."""
    temp = ""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(handle, "w") as out:
            json.dump(record, out, sort_keys=True)
        os.replace(temp, path)
    except (OSError, TypeError, ValueError) as exc:
        logger.warning("kernel choice not kept (%s): the next start times again", exc)
        if temp:
            with contextlib.suppress(OSError):
                os.unlink(temp)
