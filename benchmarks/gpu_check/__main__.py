"""python -m benchmarks.gpu_check SECTION --device cuda --out DIR [--dry-run]; see __init__.py.

Sections: env, ipc, exactness, decode, cluster (each writes DIR/SECTION.json, {"error": ...} when it fails);
report --json PATH (merges DIR's parts into ONE JSON); docs --json PATH [--doc PATH] (the docs/benchmarks.md
block from that JSON).  ipc-consumer is the ipc section's other process.
"""

from __future__ import annotations

import argparse
import json
import traceback
from pathlib import Path

from benchmarks.common import ROOT
from benchmarks.gpu_check.common import Run, device_info

SECTIONS = ("env", "ipc", "exactness", "decode", "cluster")


def _section(name: str, run: Run) -> dict:
    if name == "env":
        return device_info(run.device)
    from importlib import import_module

    return import_module(f"benchmarks.gpu_check.{name}").run(run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("section", choices=(*SECTIONS, "report", "docs", "ipc-consumer"))
    parser.add_argument("handle", nargs="?", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=ROOT / ".cache" / "gpu_check" / "parts")
    parser.add_argument("--dry-run", action="store_true", help="CPU, small sizes: checks the code, not the GPU")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "gpu_check.json")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    run = Run(args.device, args.dry_run, args.out)
    if args.section == "ipc-consumer":
        from benchmarks.gpu_check.ipc import consumer

        print(json.dumps(consumer(args.handle, args.device, args.repeats)), flush=True)
        return 0
    if args.section == "report":
        from benchmarks.gpu_check.report import merge

        doc = merge(run, args.json)
        for figure in doc["figures"]:
            print(f"{figure['name']}: {figure['value']} (target {figure['target']}) {figure['passed']}")
        print(f"gpu_check: {args.json} ({len(doc['errors'])} sections with errors)")
        return 0
    if args.section == "docs":
        from benchmarks.gpu_check.report import doc_block

        print(doc_block(args.json, args.doc))
        return 0
    try:
        data = _section(args.section, run)
    except Exception as exc:  # noqa: BLE001 - the part says what failed; report() carries it into the JSON
        data = {"error": f"{type(exc).__name__}: {exc}"[:3000], "traceback": traceback.format_exc()[-6000:]}
    run.save(args.section, data)
    print(json.dumps({"section": args.section, "error": data.get("error")}), flush=True)
    return 0 if "error" not in data else 1


if __name__ == "__main__":
    raise SystemExit(main())
