"""Start-up: how long `epd serve` takes from launch to its ready line, the CPU it spends on the way, its first answer.

Why: a replica a Kubernetes autoscaler adds serves nothing until it is ready, and a rolling update waits for
each replica in turn.  On these two cores the five processes import torch and transformers and load the model
side by side, so the time to ready is mostly CPU: the figures give both.  Each start is a fresh `epd serve`
(the demo checkpoints built once before the first); after its ready line, one text request (4 greedy tokens)
and SIGTERM (the stop figure: until every process has exited).  The kept kernel choices
(services/models/kernel_choices.py) are removed before each model's first start: it times its kernels as on a new
machine, later starts read what it kept; a figure gives that first start apart.

    python -m benchmarks.startup                          # demo and demo-medium, 5 starts each
    python -m benchmarks.startup --baseline REF           # beside the version at git REF, alternating
    python -m benchmarks.startup --quick                  # the tiny model, one start, a scratch folder
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import Figure, machine, median, print_figures, ratio, results_dir, write_doc_block, write_json
from benchmarks.procs import ROOT, free_port, tree_pids

READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 60.0
_TICK = os.sysconf("SC_CLK_TCK")


def _tree_cpu_s(root: int) -> float:
    """utime + stime of `root` and its descendants (/proc/<pid>/stat, 10 ms ticks): it counts the threads that
    ended too, as start-up's timing threads have (the per-thread schedstat benchmarks/overhead.py reads does not)."""
    total = 0.0
    for pid in tree_pids(root):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:   # ended meanwhile
            continue
        total += (int(fields[11]) + int(fields[12])) / _TICK
    return total


def start_once(tree: Path, model: str) -> dict[str, float]:
    """One `epd serve` from `tree`: seconds to its ready line, CPU seconds by then, the first answer (ms), the stop."""
    port = free_port()
    cmd = [sys.executable, "-m", "services.runtime.cli", "serve", "--model", model, "--port", str(port)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    started = time.monotonic()
    process = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    ready = threading.Event()
    tail: list[str] = []

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            tail[:] = [*tail[-40:], line]
            if line.startswith("epd ready:"):
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        while not ready.wait(0.01):
            if process.poll() is not None or time.monotonic() - started > READY_TIMEOUT_S:
                raise RuntimeError(f"epd serve from {tree} did not get ready:\n" + "".join(tail[-20:]))
        ready_s = time.monotonic() - started
        cpu_s = _tree_cpu_s(process.pid)
        body = {"model": _served(port), "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
        sent = time.monotonic()
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120)
        first_ms = (time.monotonic() - sent) * 1e3
        if reply.status_code != 200:
            raise RuntimeError(f"the first request got {reply.status_code}: {reply.text[:300]}")
        stopping = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=STOP_TIMEOUT_S)
        return {"ready_s": ready_s, "cpu_s": cpu_s, "first_ms": first_ms, "stop_s": time.monotonic() - stopping}
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


def _served(port: int) -> str:
    return str(httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"][0]["id"])


def measure(models: list[str], starts: int, trees: dict[str, Path]) -> dict[str, dict[str, list[dict[str, float]]]]:
    """Per model and side, `starts` starts; the sides alternate, the order flipping each round."""
    from services.models import kernel_choices
    from services.models.registry import resolve_model

    got: dict[str, dict[str, list[dict[str, float]]]] = {}
    for model in models:
        folder = str(resolve_model(model))   # built once here, not inside a timed start
        # the first start of each side times the kernels (--linear-kernel auto), as on a new machine; later ones
        # read the kept choices where the version keeps them
        shutil.rmtree(kernel_choices.folder(), ignore_errors=True)
        print(f"[startup] {model}: removed the kept kernel choices ({kernel_choices.folder()})", flush=True)
        got[model] = {side: [] for side in trees}
        for index in range(starts):
            for side in (list(trees) if index % 2 == 0 else list(reversed(trees))):
                one = start_once(trees[side], folder)
                got[model][side].append(one)
                print(f"[startup] {model} {side}: " + ", ".join(f"{k} {v:.2f}" for k, v in one.items()), flush=True)
    return got


FIGURES = (("ready_s", "time to ready", "s"), ("cpu_s", "CPU to ready", "s"), ("first_ms", "first answer", "ms"),
           ("stop_s", "stop", "s"))


def figures(got: dict[str, dict[str, list[dict[str, float]]]], baseline: str) -> list[Figure]:
    out = []
    for model, sides in got.items():
        for key, label, unit in FIGURES:
            values = {side: median([one[key] for one in runs]) for side, runs in sides.items()}
            starts = len(sides["A"])
            if "B" in values:
                out.append(Figure(f"{label} p50, {model}, this tree / {baseline}", ratio(values["A"], values["B"]),
                                  unit="x", note=f"{values['A']:.2f} vs {values['B']:.2f} {unit}; {starts} starts each",
                                  detail=values))
            else:
                out.append(Figure(f"{label} p50, {model}", values["A"], unit=unit, note=f"{starts} starts",
                                  detail=values))
        if "B" in sides and sides["A"] and sides["B"]:
            first = {side: runs[0]["ready_s"] for side, runs in sides.items()}
            out.append(Figure(f"time to ready, first start, {model}, this tree / {baseline}",
                              ratio(first["A"], first["B"]), unit="x", detail=first,
                              note=f"{first['A']:.2f} vs {first['B']:.2f} s; both time their kernels"))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model, one start, a scratch folder")
    parser.add_argument("--models", default="", help="comma-separated demo aliases or folders (default "
                                                     "demo,demo-medium)")
    parser.add_argument("--starts", type=int, default=0, help="starts per model and side (default 5)")
    parser.add_argument("--baseline", default="", help="a git ref of epd to start beside this tree")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m] or (["demo"] if args.quick else ["demo", "demo-medium"])
    starts = args.starts or (1 if args.quick else 5)
    trees = {"A": ROOT}
    if args.baseline:
        from benchmarks.open_loop import _tree_with_kernels

        trees["B"] = _tree_with_kernels(args.baseline)
    where = machine()
    got = measure(models, starts, trees)
    found = figures(got, args.baseline)
    print_figures(found, "epd serve: start-up")
    doc: dict[str, Any] = {"figures": found, "runs": got, "models": models, "starts": starts,
                           "baseline": args.baseline, "machine": where}
    write_json(doc, results_dir(args.quick) / "startup.json")
    if not args.quick:
        command = "python -m benchmarks.startup" + (f" --baseline {args.baseline}" if args.baseline else "") + (
            f" --models {args.models}" if args.models else "") + (f" --starts {args.starts}" if args.starts else "")
        write_doc_block("startup", command, found, where=where)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
