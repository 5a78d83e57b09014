"""Decode step and LM head on this tree's panel kernel against a git ref's, alternating, in one process.

The medium demo's decode model (panel linears, the fused step, KV of `context` tokens per row in the
block pool, greedy sampling) is loaded once.  Both builds of the C kernels are loaded side by side:
this tree's (services/kernels/panel.c, fused_step.c, paged_attention.c) and the same files at REF
(`git show`), both compiled here with gcc and the flags of the variant this CPU runs (services/kernels/spec.py;
a benchmark may need a compiler, epd never does).  Every round runs one step of each batch size, and the LM head alone
on the same rows, through each build in turn.  The figure is this tree / REF of the best times (below
1: this tree is faster), with the median of per-round ratios in the note.  Both builds sum each output
in the same order over k, so the script also checks that their logits are equal bit for bit.

    python -m benchmarks.panel_ref [--ref HEAD] [--batches 1,8,12,16] [--rounds 20] [--quick]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, Figure, machine, median, print_figures, results_dir, write_doc_block, write_json
from benchmarks.decode_runner import make_runner

_SOURCES = ("services/kernels/panel.c", "services/kernels/fused_step.c", "services/kernels/paged_attention.c")


def _compile(source: Path, kernel_name: str, out: Path) -> Any:
    """`source` built as this CPU's variant of `kernel_name` would be at install (services/kernels/spec.py)."""
    import ctypes
    import platform

    from services.kernels import loader, spec

    kernel = spec.KERNELS[kernel_name]
    variant = spec.VARIANTS[loader.expected(kernel_name)]
    flags = spec.compile_flags(kernel, variant, platform.machine())
    subprocess.run(["gcc", *flags, "-fPIC", "-shared", "-o", str(out), str(source), "-lm", "-fopenmp"], check=True)
    return ctypes.CDLL(str(out))


def _libraries(ref: str) -> dict[str, tuple[Any, Any]]:
    """{"tree": (panel lib, fused lib), "ref": (...)}: the kernels built from this tree and from `ref`."""
    from services.decode import fused
    from services.models import panel_linear

    work = Path(tempfile.mkdtemp(prefix="epd-panel-ref-"))

    def build(root: Path, tag: str) -> tuple[Any, Any]:
        panel = _compile(root / _SOURCES[0], "panel", work / f"panel_{tag}.so")
        step = _compile(root / _SOURCES[1], "fused_step", work / f"fused_step_{tag}.so")
        for lib, name, template in ((panel, "epd_panel_linear", panel_linear._kernel().epd_panel_linear),
                                    (step, "epd_fused_step", fused._kernel().epd_fused_step)):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = template.argtypes, template.restype
        return panel, step

    old = work / "ref"
    for rel in _SOURCES:
        text = subprocess.run(["git", "show", f"{ref}:{rel}"], cwd=ROOT, capture_output=True, check=True).stdout
        (old / rel).parent.mkdir(parents=True, exist_ok=True)
        (old / rel).write_bytes(text)
    return {"tree": build(ROOT, "tree"), "ref": build(old, "ref")}


def measure(ref: str, batches: list[int], rounds: int, context: int) -> dict[str, Any]:
    import torch

    from services.generation.params import DecodeParams
    from services.sampling.sampler import RowSampling

    libs = _libraries(ref)
    runner, seqs = make_runner("medium", batches, context, kernel="panel")
    if runner.fused is None:
        raise SystemExit(f"the fused step does not apply: {runner.step_report.reason}")
    head = runner.decoder.lm.lm_head
    torch.set_num_threads(runner.threads)
    greedy = DecodeParams(temperature=0.0)
    hidden = torch.randn(max(batches), head.in_features, generator=torch.Generator().manual_seed(0))
    kinds = ("step", "head")
    times: dict[tuple[str, int, str], list[float]] = {(k, b, v): [] for k in kinds for b in batches for v in libs}
    outputs: dict[tuple[str, int, str], Any] = {}

    def use(variant: str) -> None:
        panel, step = libs[variant]
        runner.fused._fn = step.epd_fused_step
        head._fn = panel.epd_panel_linear

    for round_ in range(rounds + 1):          # round 0 warms up
        order = list(libs) if round_ % 2 else list(reversed(libs))
        for batch in batches:
            for variant in order:
                use(variant)
                rows = [RowSampling(greedy, ()) for _ in range(batch)]
                began = time.perf_counter()
                tokens = runner.step([100] * batch, [0] * batch, seqs[:batch], rows)
                took = time.perf_counter() - began
                for seq in seqs[:batch]:
                    seq.truncate(context)
                began = time.perf_counter()
                logits = head(hidden[:batch])
                head_took = time.perf_counter() - began
                outputs.setdefault(("step", batch, variant), tokens)
                outputs.setdefault(("head", batch, variant), logits)
                if round_:
                    times[("step", batch, variant)].append(took * 1e3)
                    times[("head", batch, variant)].append(head_took * 1e3)
    use("tree")
    results = {}
    for kind in kinds:
        for batch in batches:
            new, old = times[(kind, batch, "tree")], times[(kind, batch, "ref")]
            a, b = outputs[(kind, batch, "tree")], outputs[(kind, batch, "ref")]
            same = torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
            results[f"{kind}{batch}"] = {"kind": kind, "batch": batch, "tree_ms": new, "ref_ms": old,
                                         "best_ratio": min(new) / min(old), "same": bool(same),
                                         "median_ratio": median([n / o for n, o in zip(new, old, strict=True)])}
    return {"ref": ref, "context": context, "rounds": rounds, "threads": runner.threads, "results": results}


def run(ref: str, batches: list[int], rounds: int, context: int, quick: bool) -> list[Figure]:
    where = machine()
    result = measure(ref, batches, rounds, context)
    figures = []
    for r in result["results"].values():
        what = "decode step" if r["kind"] == "step" else "LM head 151936x1024"
        same = "greedy tokens" if r["kind"] == "step" else "logits bit for bit"
        note = (f"best {min(r['tree_ms']):.2f} vs {min(r['ref_ms']):.2f} ms; median per-round ratio "
                f"{r['median_ratio']:.3f}; {same} {'the same' if r['same'] else 'DIFFER'}")
        figures.append(Figure(f"{what}, medium, {r['batch']} rows, this tree / {ref}", r["best_ratio"], None,
                              detail=r, note=note))
    where["loadavg_at_end"] = machine()["loadavg_at_start"]
    write_json({"machine": where, **result}, results_dir(quick) / f"panel_ref{'_quick' if quick else ''}.json")
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", default="HEAD", help="git ref whose kernel sources are the baseline")
    parser.add_argument("--batches", default="1,8,12,16")
    parser.add_argument("--rounds", type=int, default=None, help="default 20 (--quick: 3)")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="docs untouched, results in a scratch folder")
    args = parser.parse_args(argv)
    batches = [int(x) for x in args.batches.split(",") if x]
    rounds = args.rounds or (3 if args.quick else 20)
    figures = run(args.ref, batches, rounds, args.context, args.quick)
    if not args.quick:
        command = " ".join(["python -m benchmarks.panel_ref", *(sys.argv[1:] if argv is None else argv)])
        write_doc_block("panel-ref", command, figures)
    print_figures(figures, "panel kernel: this tree vs a git ref")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
