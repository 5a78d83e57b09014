"""The tree as a reader meets it: Python lines in services/ + coordinator/ (generated stubs excluded), per
package, the files past STYLE.md's split-before-400 line, and the import circles (tests/test_structure.py
asserts there are none).  With `--ref REF` the same lines counted at another commit (e.g. the one-path step's
end) and what each merge since added.

    python -m benchmarks.tree_facts [--ref REF]     # writes benchmarks/results/tree_facts.json
"""

from __future__ import annotations

import argparse
import subprocess
from collections import Counter
from pathlib import PurePosixPath
from typing import Any

from benchmarks.common import ROOT, machine, results_dir, write_json

SOURCES = ("services", "coordinator")


def _counted(path: str) -> bool:
    return path.endswith(".py") and path.split("/")[0] in SOURCES and "_pb2" not in path


def lines_at(ref: str | None) -> dict[str, int]:
    """Lines per counted file, in the working tree (ref None) or at git `ref`."""
    if ref is None:
        files = [p.relative_to(ROOT).as_posix() for top in SOURCES for p in (ROOT / top).rglob("*.py")]
        return {f: (ROOT / f).read_text(encoding="utf-8").count("\n") for f in files if _counted(f)}
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "-r", "--name-only", ref, *SOURCES],
                            check=True, capture_output=True, text=True).stdout.split()
    return {f: subprocess.run(["git", "-C", str(ROOT), "show", f"{ref}:{f}"], check=True,
                              capture_output=True, text=True).stdout.count("\n") for f in listed if _counted(f)}


def merges_since(ref: str) -> list[dict[str, Any]]:
    """Each merge into the first-parent line since `ref`: the net lines it brought into the counted files."""
    log = subprocess.run(["git", "-C", str(ROOT), "log", "--merges", "--first-parent", "--format=%H %s",
                          f"{ref}..HEAD"], check=True, capture_output=True, text=True).stdout.splitlines()
    out = []
    for line in log:
        commit, _, subject = line.partition(" ")
        stat = subprocess.run(["git", "-C", str(ROOT), "diff", "--numstat", f"{commit}^1", commit, "--", *SOURCES],
                              check=True, capture_output=True, text=True).stdout.splitlines()
        net = sum(int(a) - int(d) for a, d, path in (s.split("\t") for s in stat) if a != "-" and _counted(path))
        out.append({"commit": commit[:10], "subject": subject[:100], "net_lines": net})
    return out


def facts(ref: str | None = None) -> dict[str, Any]:
    from tests.test_structure import _circles, _modules, _targets

    counted = lines_at(None)
    packages = Counter({str(PurePosixPath(f).parent): 0 for f in counted})
    for f, n in counted.items():
        packages[str(PurePosixPath(f).parent)] += n
    modules = _modules()
    doc: dict[str, Any] = {
        "lines": sum(counted.values()), "files": len(counted),
        "lines_per_package": dict(sorted(packages.items())),
        "files_over_400_lines": {f: n for f, n in sorted(counted.items()) if n >= 400},
        "import_circles": _circles({name: _targets(name, path, modules) for name, path in modules.items()})}
    if ref is not None:
        doc["at_ref"] = {"ref": ref, "lines": sum(lines_at(ref).values()), "merges_since": merges_since(ref)}
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", help="also count the lines at this commit, and what each merge since added")
    args = parser.parse_args(argv)
    doc = {"command": "python -m benchmarks.tree_facts" + (f" --ref {args.ref}" if args.ref else ""),
           "machine": machine(), **facts(args.ref)}
    path = write_json(doc, results_dir(False) / "tree_facts.json")
    print(f"{doc['lines']} lines in {doc['files']} files; import circles: {len(doc['import_circles'])}; "
          f"files over 400 lines: {len(doc['files_over_400_lines'])}; wrote {path.relative_to(ROOT)}")
    if "at_ref" in doc:
        at = doc["at_ref"]
        print(f"at {at['ref']}: {at['lines']} lines; merges since: "
              + ", ".join(f"{m['commit']} {m['net_lines']:+d}" for m in at["merges_since"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
