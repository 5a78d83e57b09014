"""Open-loop latency as users measure it: vLLM's own `vllm bench serve` (Poisson arrivals) against epd and a baseline.

    python -m benchmarks.open_loop                        # demo-medium, epd vs vLLM CPU, rates 0.5 1 2 3, image + text
    python -m benchmarks.open_loop --model demo-deep      # the second shape: 16 layers, 6 heads of 128 (open_loop_deep)
    python -m benchmarks.open_loop --model smollm2 --workloads text   # real weights, text only (open_loop_smollm2)
    python -m benchmarks.open_loop --rates 1,2 --baseline 6fd4072 --name open_loop_arbiter   # epd vs an older epd
    python -m benchmarks.open_loop --rates 1,2 --baseline self --baseline-flag=--role-nice=decode=0 --name nice0
                                                          # epd as shipped vs epd with other flags (B only)
    python -m benchmarks.open_loop --model demo-deep --workloads text --rates 2 --seed 1 --baseline main
                                                          # replay one rate of a wider run (its seed: its place)
    python -m benchmarks.open_loop --quick                # tiny model, one rate, 6 requests, epd vs itself, temp folder
    python -m benchmarks.open_loop --model demo-deep --from-json   # figures, plots, docs block again from the JSON

The load generator is `vllm bench serve` from the vLLM peer venv (benchmarks.peers.vllm_env; FACTS.md's command
line): `--dataset-name random-mm` (one random 224x224 image, 64 random prompt tokens, 48 output tokens, ignore_eos)
and `--dataset-name random` (text, same lengths), `--request-rate R` with Poisson arrivals, goodput under TTFT <= 2
s and TPOT <= 100 ms. epd is told that SLO as its admission targets (`--ttft-slo-ms 2000 --tpot-slo-ms 100`,
coordinator/slo_gate.py: past capacity a request that would miss it is answered 429 at once), as an operator with
that SLO runs it; vLLM has no such setting. `--no-slo` starts epd without them. Both servers are up at once; every
(workload, rate) runs A then B, the next one B then A, so a drift of the shared machine's load falls on both sides
alike. Each (workload, rate) draws its requests from its own seed, the same on both sides: a server never meets an
earlier run's prompts and images again (both cache them; one seed for every run read the later rates' TTFT off warm
caches). Baselines: `vllm` (`vllm serve` on the same folder, float32; its CPU attention needs head_dim >= 32, the
medium demo model has 64), a git ref (epd at that commit, started beside this tree's: the native kernels this tree
built are copied into it, their sources being the same), or `self` (this tree twice: the quick mode's smoke run).

Figures, epd / baseline: TTFT p50 and p99, TPOT p50, goodput, per workload and rate, and a plot of each against the
rate for both sides (docs/img/<name>_<workload>.png).  Writes
benchmarks/results/<name>.json (every run's `vllm bench serve` result, per-request lists dropped) and, for a
vs-vLLM run of one of the SHAPES under its own name, its block of docs/benchmarks.md (`open-loop`,
`open-loop-deep`, `open-loop-smollm2`): a default is checked on more than one checkpoint shape.  --quick writes
to a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, Figure, machine, print_figures, ratio, results_dir, write_doc_block, write_json
from benchmarks.procs import Server, exit_on_sigterm, running, start_epd, tree_at

SERVED = "bench-model"
# The checkpoint shapes whose vs-vLLM runs the docs show, and each one's results name.
SHAPES = {"demo-medium": "open_loop", "demo-deep": "open_loop_deep", "smollm2": "open_loop_smollm2"}
# named runs beside the shapes' that have a docs block too (their commands are in the blocks), each with its baseline:
# open_loop_nice(_deep): the A/B behind `epd serve`'s decode niceness (services/hostcpu/role_cpu.py)
DOC_RUNS = {"open_loop_overload": "vllm", "open_loop_smollm2_tail": "vllm", "open_loop_deep_tail": "vllm",
            "open_loop_smollm2_4rps": "vllm",   # SmolLM2 text at 4 req/s: vLLM still keeps up (its capacity is above)
            "open_loop_nice": "self", "open_loop_nice_deep": "self",
            # decode's turn (services/hostcpu/compute_lease.py): after it / main before it, two shapes
            "open_loop_turn_deep": "4e4b98e", "open_loop_turn_smollm2": "4e4b98e"}
GOODPUT = ("ttft:2000", "tpot:100")
SLO_FLAGS = ("--ttft-slo-ms", "2000", "--tpot-slo-ms", "100")   # the same SLO, as epd's admission targets
DROP = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "queue_times", "generated_texts",
        "errors")
WORKLOADS: dict[str, tuple[str, ...]] = {
    "image": ("--dataset-name", "random-mm", "--random-mm-base-items-per-request", "1",
              "--random-mm-num-mm-items-range-ratio", "0", "--random-mm-limit-mm-per-prompt",
              '{"image": 1, "video": 0}', "--random-mm-bucket-config", "{(224, 224, 1): 1.0}"),
    "text": ("--dataset-name", "random"),
}


@dataclass(frozen=True)
class Setup:
    model: str = "demo-medium"
    rates: tuple[float, ...] = (0.5, 1.0, 2.0, 3.0)
    workloads: tuple[str, ...] = ("image", "text")
    num_prompts: int = 40            # per (workload, rate, side)
    input_len: int = 64
    output_len: int = 48
    baseline: str = "vllm"
    epd_flags: tuple[str, ...] = ()
    slo: bool = True                 # epd admits against the goodput SLO (SLO_FLAGS)
    baseline_flags: tuple[str, ...] = ()   # an epd baseline's own extra flags (after epd_flags: they win)
    name: str = "open_loop"
    quick: bool = False
    from_json: bool = False          # nothing measured: benchmarks/results/<name>.json read back
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def quick_run(cls) -> Setup:
        return cls(model="demo", rates=(2.0,), workloads=("image",), num_prompts=6, output_len=8, baseline="self",
                   name="open_loop_quick", quick=True)


def bench_command(setup: Setup, url: str, folder: Path, workload: str, rate: float, out: Path,
                  seed: int = 0) -> list[str]:
    """`vllm bench serve` for one (workload, rate) against `url`, its result JSON written to `out`.  `seed` draws
    the prompts and images: the two sides of one (workload, rate) get the same seed (the same requests), each
    (workload, rate) its own, so no run finds the prompts and images of an earlier one in a server's caches."""
    from benchmarks.peers import vllm_env

    vllm = vllm_env.venv_dir() / "bin" / "vllm"
    return [str(vllm), "bench", "serve", "--backend", "openai-chat", "--base-url", url,
            "--endpoint", "/v1/chat/completions", "--model", SERVED, "--tokenizer", str(folder),
            *WORKLOADS[workload], "--random-input-len", str(setup.input_len),
            "--random-output-len", str(setup.output_len), "--random-range-ratio", "0", "--ignore-eos",
            "--num-prompts", str(setup.num_prompts), "--request-rate", str(rate), "--seed", str(seed),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--goodput", *GOODPUT, "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir",
            str(out.parent), "--result-filename", out.name]


def run_bench(setup: Setup, server: Server, folder: Path, workload: str, rate: float, scratch: Path,
              seed: int = 0) -> dict[str, Any]:
    from benchmarks.peers import vllm_env

    out = scratch / f"{server.name}_{workload}_{rate:g}.json"
    out.unlink(missing_ok=True)
    env = {**vllm_env.SERVE_ENV}
    before = refusals(server)
    timeout = 300 + setup.num_prompts * 60 / max(rate, 0.1)
    proc = subprocess.run(bench_command(setup, server.url, folder, workload, rate, out, seed), env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve against {server.name} failed ({proc.returncode}):\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    result = compact(json.loads(out.read_text()))
    after = refusals(server)
    if after is not None and before is not None:
        refused = {reason: count - before.get(reason, 0) for reason, count in after.items()
                   if count > before.get(reason, 0)}
        if refused:
            result["refused"] = refused
    return result


REFUSED = re.compile(r'^epd_coordinator_rejected_requests_total\{reason="([^"]+)"\} ([0-9.e+]+)$', re.M)


def refusals(server: Server) -> dict[str, int] | None:
    """epd's 429s so far, by the rule that refused (its coordinator's /metrics); None for a server without them."""
    import urllib.request

    if not server.name.startswith("epd"):
        return None
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return {reason: int(float(count)) for reason, count in REFUSED.findall(text)}


def _why(result: dict[str, Any]) -> str:
    """What the failed requests of a run met, counted: "2 429, 1 disconnected" ("" when none or not kept)."""
    kinds: dict[str, int] = {}
    for error in (result.get("requests") or {}).get("errors", {}).values():
        kind = "429" if "Too Many Requests" in error or "429" in error else \
            "disconnected" if "Disconnected" in error else "other"
        kinds[kind] = kinds.get(kind, 0) + 1
    refused = result.get("refused") or {}
    rules = " (" + ", ".join(f"{count} {rule}" for rule, count in sorted(refused.items())) + ")" if refused else ""
    return ", ".join(f"{count} {kind}" + (rules if kind == "429" else "") for kind, count in kinds.items())


def compact(result: dict[str, Any]) -> dict[str, Any]:
    """A run's result without its per-request lists, but for each request's start (s after the first) and TTFT
    (ms; None for one that failed) in the order sent: which requests made the tail, and what arrived with them;
    and why each failed one failed (the error's last line: a 429 of the SLO gate is not a lost connection)."""
    kept = {key: value for key, value in result.items() if key not in DROP}
    starts, ttfts, errors = result.get("start_times") or [], result.get("ttfts") or [], result.get("errors") or []
    if starts and len(starts) == len(ttfts):
        kept["requests"] = {"start_s": [round(t - starts[0], 3) for t in starts],
                            "ttft_ms": [None if (index < len(errors) and errors[index]) else round(ttft * 1000, 1)
                                        for index, ttft in enumerate(ttfts)]}
        failed = {str(index): error.strip().splitlines()[-1][:200] for index, error in enumerate(errors)
                  if error and error.strip()}
        if failed:
            kept["requests"]["errors"] = failed
    return kept


def start_baseline(setup: Setup, folder: Path) -> Server:
    if setup.baseline == "vllm":
        from benchmarks.peers import vllm_env

        return vllm_env.start_serve(folder, "--served-model-name", SERVED, timeout_s=1800.0)
    flags = ("--served-model-name", SERVED, "--max-inflight-requests", "1024", *epd_flags(setup),
             *setup.baseline_flags)
    if setup.baseline == "self":
        server = start_epd(str(folder), *flags)
    else:
        server = start_epd(str(folder), *flags, root=_tree_with_kernels(setup.baseline))
    server.name = f"epd@{setup.baseline}"
    return server


def epd_flags(setup: Setup) -> tuple[str, ...]:
    """`epd serve`'s flags beyond the model's: the SLO's admission targets (unless --no-slo), then --epd-flag's."""
    return (*(SLO_FLAGS if setup.slo else ()), *setup.epd_flags)


def _tree_with_kernels(ref: str) -> Path:
    """epd at `ref`, with this tree's built native kernels copied in (git holds their sources, not the builds)."""
    tree = tree_at(ref)
    for built in (ROOT / "services" / "kernels").glob("_*.so"):
        if not (tree / "services" / "kernels" / built.name).exists():
            shutil.copy2(built, tree / "services" / "kernels" / built.name)
    return tree


def measure(setup: Setup) -> dict[str, Any]:
    from services.models.registry import resolve_model

    folder = resolve_model(setup.model)
    where = machine()
    scratch = results_dir(True) / "open_loop_runs"
    scratch.mkdir(parents=True, exist_ok=True)
    epd = start_epd(str(folder), "--served-model-name", SERVED, "--max-inflight-requests", "1024",
                    *epd_flags(setup))
    with running(epd):
        baseline = start_baseline(setup, folder)
        with running(baseline):
            runs: list[dict[str, Any]] = []
            order = 0
            for workload in setup.workloads:
                for rate in setup.rates:
                    sides = (epd, baseline) if order % 2 == 0 else (baseline, epd)
                    seed = setup.seed + order
                    order += 1
                    for server in sides:
                        result = run_bench(setup, server, folder, workload, rate, scratch, seed)
                        side = "A" if server is epd else "B"
                        runs.append({"workload": workload, "rate": rate, "side": side, "server": server.name,
                                     "seed": seed, "result": result})
                        print(f"[open_loop] {workload} {rate:g} req/s {server.name}: TTFT p50 "
                              f"{result.get('median_ttft_ms', 0):.0f} ms, TPOT p50 "
                              f"{result.get('median_tpot_ms', 0):.1f} ms, goodput "
                              f"{result.get('request_goodput') or 0:.2f} req/s", flush=True)
    return {"setup": {k: v for k, v in setup.__dict__.items() if k not in ("extra", "from_json")}, "machine": where,
            "model_folder": str(folder), "baseline": baseline.name, "runs": runs}


def figures(doc: dict[str, Any]) -> list[Figure]:
    """epd / baseline per (workload, rate): TTFT p50, TTFT p99, TPOT p50 (lower is better), goodput (higher)."""
    out: list[Figure] = []
    setup = doc["setup"]
    for workload in setup["workloads"]:
        for rate in setup["rates"]:
            pair = {r["side"]: r["result"] for r in doc["runs"] if r["workload"] == workload and r["rate"] == rate}
            if set(pair) != {"A", "B"}:
                continue
            for key, label, op, unit in (("median_ttft_ms", "TTFT p50", "le", "ms"),
                                         ("p99_ttft_ms", "TTFT p99", "le", "ms"),
                                         ("median_tpot_ms", "TPOT p50", "le", "ms"),
                                         ("request_goodput", "goodput", "ge", "req/s")):
                a, b = pair["A"].get(key), pair["B"].get(key)
                note = f"{a:.1f} vs {b:.1f} {unit}" if a is not None and b is not None else "n/a"
                if key == "request_goodput":   # what was refused (epd's 429s) or failed, beside what met the SLO
                    note += f"; failed {pair['A'].get('failed', 0)} vs {pair['B'].get('failed', 0)}"
                    why = [_why(pair[side]) for side in ("A", "B")]
                    if any(why):
                        note += f" ({' / '.join(w or '-' for w in why)})"
                out.append(Figure(f"{label}, {workload}, {rate:g} req/s, epd / {doc['baseline']}", ratio(a, b),
                                  None, op, note=note))
    return out


def plot(doc: dict[str, Any], workload: str, path: Path) -> None:
    """TTFT p50 and p99, TPOT p50 and goodput against the request rate, one line per side (epd, the baseline)."""
    from services.bench.plots import Panel, Series, save_figure

    setup = doc["setup"]
    names = {"A": "epd", "B": doc["baseline"]}
    panels = []
    for key, heading, unit in (("median_ttft_ms", "TTFT p50", "ms"), ("p99_ttft_ms", "TTFT p99", "ms"),
                               ("median_tpot_ms", "TPOT p50", "ms"), ("request_goodput", "goodput", "req/s")):
        series = []
        for side in ("A", "B"):
            points = sorted((r["rate"], r["result"].get(key)) for r in doc["runs"]
                            if r["workload"] == workload and r["side"] == side and r["result"].get(key) is not None)
            series.append(Series(names[side], tuple(float(x) for x, _ in points), tuple(float(y) for _, y in points)))
        panels.append(Panel(f"{heading} vs request rate", "request rate (req/s, Poisson)", f"{heading} ({unit})",
                            tuple(series)))
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(str(path), panels, title=(f"vllm bench serve, {workload}: epd vs {doc['baseline']}",
                                          f"{setup['model']}, {setup['num_prompts']} requests per rate and side"))


def default_name(model: str) -> str:
    """The results name of a run on `model`: its shape's, or open_loop_<folder name> (never a shape's JSON)."""
    return SHAPES.get(model) or "open_loop_" + (re.sub(r"\W+", "_", Path(model).name).strip("_") or "model")


def parse(argv: list[str] | None) -> tuple[Setup, bool]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, one rate, 6 requests, epd vs itself")
    parser.add_argument("--model", default=Setup.model, help="demo alias or checkpoint folder (default demo-medium)")
    parser.add_argument("--rates", default="", help="comma-separated request rates, req/s (default 0.5,1,2,3)")
    parser.add_argument("--workloads", default="", help="image,text (default both)")
    parser.add_argument("--num-prompts", type=int, default=0, help="requests per workload, rate and side")
    parser.add_argument("--baseline", default="", help="vllm (default) | self | a git ref of epd")
    parser.add_argument("--seed", type=int, default=0, help="the first (workload, rate)'s seed, each next one's +1 "
                        "(default 0): --rates R --seed S replays the arrivals and prompts of a wider run's rate R")
    parser.add_argument("--epd-flag", action="append", default=[], help="an extra `epd serve` flag (both epd sides)")
    parser.add_argument("--no-slo", action="store_true", help="start epd without the goodput SLO as its admission "
                        "targets (--ttft-slo-ms / --tpot-slo-ms)")
    parser.add_argument("--baseline-flag", action="append", default=[],
                        help="an extra `epd serve` flag for an epd baseline only (self or a git ref): A/B of a setting")
    parser.add_argument("--from-json", action="store_true", help="measure nothing: the figures, plots and docs block "
                        "again from benchmarks/results/<name>.json (a run's own JSON)")
    parser.add_argument("--name", default="", help="the JSON's name (default: the shape's, open_loop for "
                        "demo-medium, else open_loop_<folder name>; names other than a shape's or DOC_RUNS' "
                        "skip the docs)")
    args = parser.parse_args(argv)
    if args.baseline_flag and args.baseline in ("", "vllm"):
        parser.error("--baseline-flag needs an epd baseline (--baseline self or a git ref)")
    setup = Setup.quick_run() if args.quick else Setup()
    changes: dict[str, Any] = {"model": args.model if args.model != Setup.model or not args.quick else setup.model}
    if args.rates:
        changes["rates"] = tuple(float(r) for r in args.rates.split(","))
    if args.workloads:
        changes["workloads"] = tuple(w for w in args.workloads.split(",") if w)
        unknown = set(changes["workloads"]) - set(WORKLOADS)
        if unknown:
            parser.error(f"unknown workloads {sorted(unknown)}; known: {', '.join(WORKLOADS)}")
    for key, value in (("num_prompts", args.num_prompts), ("baseline", args.baseline),
                       ("name", args.name or ("" if args.quick else default_name(changes["model"])))):
        if value:
            changes[key] = value
    if changes.get("baseline") not in (None, "vllm", "self"):   # a git ref: named by its commit, which stays
        changes["baseline"] = commit_of(changes["baseline"])
    changes["seed"] = args.seed
    changes["epd_flags"] = tuple(args.epd_flag)
    changes["slo"] = not args.no_slo
    changes["baseline_flags"] = tuple(args.baseline_flag)
    changes["from_json"] = args.from_json
    setup = Setup(**{**setup.__dict__, **changes})
    return setup, has_docs(setup)


def commit_of(ref: str) -> str:
    """`ref`'s commit, abbreviated (a branch such as main moves on; the run's JSON names what it measured)."""
    found = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=7", f"{ref}^{{commit}}"],
                           capture_output=True, text=True)
    if found.returncode != 0:
        raise SystemExit(f"--baseline {ref}: not a git ref of this repository ({found.stderr.strip()})")
    return found.stdout.strip()


def has_docs(setup: Setup) -> bool:
    """Whether a run writes a docs block: a shape's run beside vLLM, or a named run (DOC_RUNS) beside its baseline."""
    return not setup.quick and (DOC_RUNS.get(setup.name) == setup.baseline
                                or (setup.baseline == "vllm" and setup.name == SHAPES.get(setup.model)))


def main(argv: list[str] | None = None) -> int:
    exit_on_sigterm()
    setup, docs = parse(argv)
    path = results_dir(setup.quick) / f"{setup.name}.json"
    if setup.from_json:
        doc = json.loads(path.read_text())
        setup = Setup(**{**doc["setup"], "rates": tuple(doc["setup"]["rates"]),
                         "workloads": tuple(doc["setup"]["workloads"]), "epd_flags": tuple(doc["setup"]["epd_flags"]),
                         "baseline_flags": tuple(doc["setup"]["baseline_flags"])})
        docs = has_docs(setup)   # the run's own baseline, not the command line's
        command = doc.get("command") or "python -m benchmarks.open_loop" + (
            f" --model {setup.model}" if setup.model != Setup.model else "")
    else:
        doc = measure(setup)
        command = ("python -m benchmarks.open_loop " + " ".join(sys.argv[1:] if argv is None else argv)).strip()
        doc["command"] = command
    found = figures(doc)
    doc["figures"] = found
    write_json(doc, path)
    print_figures(found, f"open loop, epd / {doc['baseline']} ({path})")
    if docs:
        images = []
        for workload in setup.workloads:
            png = ROOT / "docs" / "img" / f"{setup.name}_{workload}.png"
            plot(doc, workload, png)
            images.append(f"![{workload}](img/{png.name})")
        write_doc_block(setup.name.replace("_", "-"), command, found,
                        extra=f"`vllm bench serve` (Poisson arrivals), {setup.num_prompts} requests per workload, "
                              f"rate and side; image: one random 224x224 image + {setup.input_len} random tokens, "
                              f"text: {setup.input_len} random tokens; {setup.output_len} output tokens, "
                              f"ignore_eos; {setup.model}, float32; goodput SLO TTFT <= 2 s, TPOT <= 100 ms"
                              + (", given to epd as its admission targets (`--ttft-slo-ms 2000 --tpot-slo-ms 100`: "
                                 "a request that would miss it is answered 429 at once, counted failed); vLLM has "
                                 "no such setting. " if setup.slo else ". ") +
                              (f"Baseline: epd with `{' '.join(setup.baseline_flags)}`. " if setup.baseline_flags
                               else "") +
                              f"Raw results: benchmarks/results/{setup.name}.json.\n\n" + " ".join(images),
                        where=doc["machine"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
