"""Every target of issue 4 (section 4), each printed as a ratio measured in one run.

    python -m benchmarks.targets            # full: tiny + medium clusters and the peer, ~20 minutes here
    python -m benchmarks.targets --quick    # tiny model only, a few requests (the smoke test runs this)
    python -m benchmarks.targets --only connectors,decode

Groups (each can be chosen with --only):
- connectors: shm and redis, 16 MiB put + get vs their baselines (benchmarks/connectors.py);
- decode: decode tokens/s, 16 streams vs 1, tiny model (benchmarks/decode_scaling.py);
- tiny: a tiny-model cluster for the orchestration overhead (benchmarks/overhead.py) and the
  bytes prefill receives for a 1024x768 image (benchmarks/payload.py);
- medium: the medium model, epd and `transformers serve` side by side at concurrency 1 and 16
  (benchmarks/vs_transformers_serve.py, which also refreshes its docs table), then image
  reuse 80% vs 0% on the same epd cluster (benchmarks/reuse.py).
In --quick mode "tiny" and "medium" share one tiny cluster and a tiny peer.

Results: benchmarks/results/targets[_quick].json; the table in docs/benchmarks.md (full mode,
unless --no-docs).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from benchmarks import connectors, decode_scaling, overhead, payload, reuse, vs_transformers_serve
from benchmarks.common import (
    ROOT,
    Figure,
    machine,
    markdown_table,
    print_figures,
    replace_block,
    results_dir,
    write_json,
)
from benchmarks.procs import running, start_epd

GROUPS = ("connectors", "decode", "tiny", "medium")


def _connectors(quick: bool) -> list[Figure]:
    return connectors.run(quick)


def _decode(quick: bool) -> list[Figure]:
    return decode_scaling.run(quick)


def _tiny(quick: bool) -> list[Figure]:
    with running(start_epd("demo")) as (epd,):
        return overhead.run(quick, epd) + payload.run(quick, epd)


def _medium(quick: bool) -> list[Figure]:
    setup = vs_transformers_serve.SideBySide()
    servers = vs_transformers_serve.start_both(setup)
    try:
        side, doc = vs_transformers_serve.run(setup, servers, plots=vs_transformers_serve.IMG)
        write_json({"figures": side, "bench": doc}, results_dir(False) / "vs_transformers_serve.json")
        vs_transformers_serve.write_docs(doc, setup, "python -m benchmarks.targets --only medium")
        return side + reuse.run(reuse.ReuseSetup(), servers.epd)
    finally:
        servers.stop()


def _quick_clusters(only: set[str], servers: vs_transformers_serve.Servers) -> list[Figure]:
    """--quick: one tiny epd cluster and one tiny peer serve the tiny and medium groups."""
    setup = vs_transformers_serve.SideBySide.quick()
    figures: list[Figure] = []
    started = time.monotonic()
    if "tiny" in only:
        figures += overhead.run(True, servers.epd) + payload.run(True, servers.epd)
    if "medium" in only:
        side, doc = vs_transformers_serve.run(setup, servers)
        write_json({"figures": side, "bench": doc}, results_dir(True) / "vs_transformers_serve_quick.json")
        figures += side
        figures += reuse.run(reuse.ReuseSetup.quick(), servers.epd)
    _log(f"tiny + medium (quick, one tiny cluster) done in {time.monotonic() - started:.0f} s")
    return figures


def _stamped(figures: list[Figure], group: str, where: dict[str, Any]) -> list[Figure]:
    """Each figure keeps when it was measured and how loaded the shared machine was."""
    for figure in figures:
        figure.detail["measured"] = {"group": group, "time": where["time"], "loadavg": where["loadavg_at_start"]}
    return figures


def merged(previous: list[dict[str, Any]], new: list[Figure]) -> list[Figure]:
    """`--only` reruns replace their own figures and keep the others of the last full run, in order."""
    fresh = {f.name: f for f in new}
    kept = [fresh.pop(p["name"], None) or Figure(**{k: p[k] for k in ("name", "value", "target", "op", "unit",
                                                                     "detail", "note")}) for p in previous]
    return kept + list(fresh.values())


def _log(message: str) -> None:
    print(f"[targets] {message}", file=sys.stderr, flush=True)


def _start_in_background(setup: vs_transformers_serve.SideBySide) -> tuple[threading.Thread, dict[str, Any]]:
    """Quick mode boots the servers while the in-process groups run (their figures are not the point)."""
    box: dict[str, Any] = {}

    def start() -> None:
        try:
            box["servers"] = vs_transformers_serve.start_both(setup)
        except Exception as exc:  # re-raised by the caller
            box["error"] = exc

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    return thread, box


def run(quick: bool, only: set[str]) -> list[Figure]:
    steps: dict[str, Callable[[bool], list[Figure]]] = {"connectors": _connectors, "decode": _decode,
                                                        "tiny": _tiny, "medium": _medium}
    clusters = quick and bool(only & {"tiny", "medium"})
    booting = _start_in_background(vs_transformers_serve.SideBySide.quick()) if clusters else None
    figures: list[Figure] = []
    try:
        for name in GROUPS:
            if name in only and not (quick and name in ("tiny", "medium")):
                started, where = time.monotonic(), machine()
                figures += _stamped(steps[name](quick), name, where)
                _log(f"{name} done in {time.monotonic() - started:.0f} s")
    finally:
        if booting is not None:
            waited = time.monotonic()
            booting[0].join()
            _log(f"servers ready (waited {time.monotonic() - waited:.0f} s more)")
    if booting is not None:
        box = booting[1]
        if "error" in box:
            raise box["error"]
        try:
            figures += _quick_clusters(only, box["servers"])
        finally:
            box["servers"].stop()
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, a few requests (minutes → seconds)")
    parser.add_argument("--only", help=f"comma-separated groups: {', '.join(GROUPS)}")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    only = set(args.only.split(",")) if args.only else set(GROUPS)
    unknown = only - set(GROUPS)
    if unknown:
        parser.error(f"unknown groups {sorted(unknown)}; choose from {', '.join(GROUPS)}")
    where = machine()
    started = time.monotonic()
    figures = run(args.quick, only)
    print_figures(figures, "issue 4 targets" + (" (quick: tiny model, not the targets' setup)" if args.quick else ""))
    command = "python -m benchmarks.targets " + " ".join(argv)
    doc = {"command": command.strip(), "machine": where, "seconds": time.monotonic() - started, "figures": figures}
    path = results_dir(args.quick) / f"targets{'_quick' if args.quick else ''}.json"
    if args.only and not args.quick and path.exists():
        doc["figures"] = figures = merged(json.loads(path.read_text())["figures"], figures)
    write_json(doc, path)
    if not args.quick and not args.no_docs:
        body = (f"Command: `python -m benchmarks.targets` ({where['cpus']} CPUs shared with other jobs; a group "
                f"rerun with `--only GROUP` replaces its own rows and keeps the others). The last column gives "
                f"when each group ran and the 1/5/15-minute load average then.\n\n" + markdown_table(figures))
        replace_block(ROOT / "docs" / "benchmarks.md", "targets", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
