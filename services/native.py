"""Small C kernels compiled at first use with the machine's gcc, cached by source hash.

`build_library(source, name, flags)` returns a ctypes CDLL of `source` compiled with `flags` into
`$EPD_CACHE_DIR/kernels` (default ~/.cache/epd/kernels), one file per (source, flags) digest,
written under a temporary name and renamed into place so concurrent builders never load half a
file.  It raises OSError when gcc is missing or refuses the source (say, no AVX2 on this CPU):
callers fall back to a torch path.  Used by services/decode/attention.py (paged attention) and
services/models/panel_linear.py (small-batch linear layers) and services/decode/fused.py (the whole
decoder stack of a decode step in one call).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

BASE_FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-pthread")


def cache_dir() -> Path:
    root = os.environ.get("EPD_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "epd")
    return Path(root) / "kernels"


def build_library(source: Path, name: str, flags: tuple[str, ...], libs: tuple[str, ...] = ("-lm",),
                  includes: tuple[Path, ...] = ()) -> ctypes.CDLL:
    """The compiled `source` (built once per source, the files it `#include`s from this project
    (`includes`, so an edit of one rebuilds it) and flags); raises OSError if gcc fails."""
    text = source.read_bytes() + b"".join(path.read_bytes() for path in includes)
    digest = hashlib.sha256(text + " ".join((*flags, *libs)).encode()).hexdigest()[:16]
    target = cache_dir() / f"{name}_{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
            partial = Path(tmp.name)
        try:
            subprocess.run(["gcc", *flags, "-o", str(partial), str(source), *libs], check=True,
                           capture_output=True, timeout=120)
            partial.replace(target)
        except subprocess.CalledProcessError as exc:
            partial.unlink(missing_ok=True)
            error = exc.stderr.decode(errors="replace").strip().splitlines()
            raise OSError(f"building {name} failed: {error[0] if error else exc}") from exc
        except (subprocess.SubprocessError, FileNotFoundError) as exc:
            partial.unlink(missing_ok=True)
            raise OSError(f"building {name} failed: {exc}") from exc
    return ctypes.CDLL(str(target))
