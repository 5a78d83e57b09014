"""`python -m services.kernels.check [--json]`: which variant of each native kernel this machine runs.

Prints every kernel of services/kernels/spec.py with the variant loaded here and the one this CPU should run
(the best its features allow, after EPD_CPU_FEATURES_OFF; EPD_KERNELS_OFF counts as wanted), and exits 1 if
any differs: a library missing from the install, refused, or failing to load.  The Docker build runs it
after `pip install .`, so an image without its kernels fails to build instead of serving on torch's slower
paths; an operator runs it on a node to see what epd will run there.
"""

from __future__ import annotations

import argparse
import json
import sys

from services.kernels import cpu, loader
from services.kernels.spec import KERNELS, VARIANTS

DOC_BLOCK = "kernel-variants"   # docs/deployment.md's generated table (`--markdown` prints it)


def table() -> dict[str, dict[str, str]]:
    """kernel -> {"variant": what loaded, "expected": what this CPU should run, "reason": why not, if so}."""
    off = loader.off_names()
    out = {}
    for name in sorted(KERNELS):
        got = loader.load(name)
        expected = "off" if name in off else (loader.expected(name) or "unsupported")
        out[name] = {"variant": got.variant, "expected": expected, "reason": got.reason}
    return out


def markdown() -> str:
    """What runs where, from spec.py: per kernel, the variants built on x86-64 and elsewhere, best first."""
    lines = ["| kernel | roles | x86-64, best first | aarch64, other CPUs | where none runs |", "|---|---|---|---|---|"]
    for name, kernel in sorted(KERNELS.items()):
        roles = ", ".join(role for role, names in loader.ROLE_KERNELS.items() if name in names) or "shm connector"
        other = "portable" if "portable" in kernel.variants else "-"
        lines.append(f"| {name} | {roles} | {' > '.join(kernel.variants)} | {other} | {kernel.fallback} |")
    lines += ["", "Variants and the CPU features (/proc/cpuinfo) each needs: " + "; ".join(
        f"{v.name}: {'+'.join(v.features) or 'any CPU'}" for v in VARIANTS.values()) + "."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    parser.add_argument("--markdown", action="store_true", help="the what-runs-where table of docs/deployment.md")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown())
        return 0
    rows = table()
    bad = {name: row for name, row in rows.items() if row["variant"] != row["expected"]}
    if args.json:
        print(json.dumps({"kernels": rows, "ok": not bad}))
    else:
        have = ",".join(sorted(cpu.features() & loader.RELEVANT)) or "none"
        print(f"cpu features the kernels use: {have}")
        for name, row in rows.items():
            mark = "" if name not in bad else f"   <- expected {row['expected']}: {row['reason']}"
            print(f"{name:20} {row['variant']}{mark}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
