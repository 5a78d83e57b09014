"""The CPU features this process may use, as Linux names them, minus the ones EPD_CPU_FEATURES_OFF masks.

Linux lists in /proc/cpuinfo ("flags" on x86, "Features" on aarch64) only the features both the CPU and
the kernel support (AVX-512 disappears from it where the OS does not save the zmm registers), so a
variant whose features are all listed can run here.  Elsewhere (no /proc/cpuinfo) the set is empty and
only portable variants run.

EPD_CPU_FEATURES_OFF (the --cpu-features-off setting) removes features from that set, comma-separated:
`avx512f` leaves every AVX-512 variant out, `avx2` every AVX2 and AVX-512 one, `all` every feature (the
portable variants only).  Tests use it to run each fallback on a machine that has the ISA; an operator can
use it to run one variant across a fleet of mixed CPUs.
"""

from __future__ import annotations

import os
from functools import lru_cache

ENV = "EPD_CPU_FEATURES_OFF"
CPUINFO = "/proc/cpuinfo"


@lru_cache(maxsize=1)
def detected(path: str = CPUINFO) -> frozenset[str]:
    """The features the first processor of `path` lists (empty where there is no such file)."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip().lower() in ("flags", "features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def masked() -> frozenset[str]:
    """What EPD_CPU_FEATURES_OFF names ("all" is every detected feature)."""
    names = {part.strip().lower() for part in os.environ.get(ENV, "").split(",") if part.strip()}
    return detected() if "all" in names else frozenset(names)


def features() -> frozenset[str]:
    """Detected minus masked: what a variant may require."""
    return detected() - masked()


def has(required: tuple[str, ...] | list[str]) -> bool:
    return set(required) <= features()
