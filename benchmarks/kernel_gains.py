"""Does each native kernel earn its place?  Each one on and off, two medium clusters side by side.

For every kernel (services/kernels/) and decode step path: A = `epd serve --model demo-medium` with it on,
B = the same with it off (`EPD_KERNELS_OFF=<kernel>`, or the flag that turns the path off), both started
at once and the requests alternating between them in rounds (A B, B A, ...), so the load of other jobs on
this shared machine falls on both sides.  Workload: 64 words + one image (224x224; 1024x768 for the
resize, which a 224x224 image never reaches), 32 output tokens (4 for the TTFT cases), greedy, ignore_eos,
at c=1 (6 requests a side) and c=16 (32 a side), every role at nice 0 (`COMMON`).  Each kernel is judged
on the figure it targets: TTFT p50 for the prompt stages' kernels, TPOT p50 at c=1 and output tok/s at
c=16 for decode's.  Gain = how much worse B is than A (TTFT, TPOT: B / A - 1; tok/s: A / B - 1); a kernel
is kept when its gain reaches 10% at c=1 or at c=16.

Kernels that only run when another path is off are measured there: the panel linears and the paged
attention kernel serve the eager decode step, so both sides of theirs run `--decode-fused off`.  The compiled
decode step (`--decode-step compiled`, torch.compile) was compared with the eager one likewise, and deleted;
its row keeps the commit it was measured at.

    python -m benchmarks.kernel_gains [--kernels a,b] [--quick] [--no-docs] [--levels 1:8,16:32]

Every run but --quick writes benchmarks/results/kernel_gains.json and the kernel-gains block of
docs/benchmarks.md; `--kernels` reruns some cases and merges them into that JSON, each row showing its newest
run (with `--levels`, more requests a side where a first reading was near the 10% line) and what the earlier
ones read (a case no longer in CASES keeps its last row and the commit it was measured at).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from benchmarks.common import ROOT, machine, ratio, replace_block, results_dir, write_json
from benchmarks.procs import ServerError, exit_on_sigterm, running, start_epd
from benchmarks.side_by_side import parse_levels, side_figures

LEVELS = ((1, 6), (16, 32))   # (concurrency, requests per side)
OUTPUT_LEN = 32
TTFT_OUTPUT_LEN = 4   # the prompt stages' cases: TTFT is their figure, a long answer would only add time
# Every role at nice 0 on both sides: `epd serve` nices decode to 15 by default (services/hostcpu/role_cpu.py),
# which on a box shared with other jobs' processes starves decode and turns a run into hours of waiting.
# Smaller shm stores and one render worker: two medium clusters at once beside other jobs ran this 24 GiB box
# out of memory.
COMMON = ("--role-nice decode=0 --kv-capacity-mb 64 --ec-capacity-mb 64 --mm-capacity-mb 160 "
          "--render-workers 1")
QUICK_LEVELS = ((1, 2), (2, 2))
KEEP_GAIN = 0.10
SETTLE_S = 2.0
JSON_NAME = "kernel_gains.json"


@dataclass(frozen=True)
class Case:
    """One kernel on (A) and off (B): `base` flags on both sides, B's extra flags or kernels off."""

    name: str
    figure: str                     # "ttft" or "decode" (TPOT at c=1, tok/s at c=16)
    what: str
    base: str = ""
    off_flags: str = ""
    off_kernels: str = ""
    image: tuple[int, int] = (224, 224)

    def b_env(self) -> dict[str, str]:
        return {"EPD_KERNELS_OFF": self.off_kernels} if self.off_kernels else {}

    def b_text(self) -> str:
        parts = [f"`{self.off_flags}`" if self.off_flags else "", f"`EPD_KERNELS_OFF={self.off_kernels}`"
                 if self.off_kernels else ""]
        return " ".join(p for p in parts if p)


CASES = (
    Case("resize", "ttft", "render's uint8 image resize (services/kernels/resize.c)", off_kernels="resize",
         image=(1024, 768)),
    Case("prefill_attention", "ttft", "prefill's causal attention, spans up to 1,024 keys",
         off_kernels="prefill_attention"),
    Case("fused_step", "decode", "the fused decode step (the decoder stack in one C call) vs the eager step",
         off_kernels="fused_step"),
    Case("panel", "decode", "panel linears (decode's small-batch GEMMs) vs oneDNN / F.linear, eager step",
         base="--decode-fused off", off_kernels="panel"),
    Case("head_int8", "decode", "the LM head screen's int8 (VNNI) stage vs its bfloat16 pairs",
         off_kernels="head_int8"),
    Case("lm_head_screen", "decode", "the LM head screen (bfloat16 / int8 copy of the head) vs the full head",
         off_flags="--lm-head-screen off"),
)


def run_case(case: Case, quick: bool, levels: tuple[tuple[int, int], ...]) -> dict[str, Any]:
    from services.bench import BenchConfig, Endpoint, LoadConfig, WorkloadConfig, run_bench
    from services.bench.config import ImageSize
    from services.bench.report import to_json

    model = "demo" if quick else "demo-medium"
    input_len, output_len = (16, 8) if quick else (64, OUTPUT_LEN if case.figure == "decode" else TTFT_OUTPUT_LEN)
    base = shlex.split(f"{COMMON} {case.base}")
    # B's off flags come after the base ones (a later flag wins).
    a_server = start_epd(model, *base, timeout_s=900)
    with running(a_server):
        b_server = start_epd(model, *base, *shlex.split(case.off_flags), env=case.b_env(), timeout_s=1200)
        with running(b_server):
            model_id = a_server.model_id()
            done = []
            for concurrency, requests in levels:
                config = BenchConfig(
                    endpoints=(Endpoint(a_server.url, model=model_id, label="A", extra_body={"temperature": 0.0}),
                               Endpoint(b_server.url, model=model_id, label="B", extra_body={"temperature": 0.0})),
                    workload=WorkloadConfig(input_len=input_len, output_len=output_len, seed=concurrency,
                                            image_sizes=(ImageSize(*case.image),)),
                    load=LoadConfig(concurrency=concurrency, num_requests=requests, warmup=1 if quick else 2,
                                    timeout_s=1800),
                    round_size=concurrency, show_progress=False, settle_s=0.0 if quick else SETTLE_S)
                done.extend(to_json(run_bench(config))["levels"])
            kernels = {"A": kernel_info(a_server), "B": kernel_info(b_server)}
    return judge(case, done, output_len, kernels)


def kernel_info(server: Any) -> dict[str, str]:
    """epd_kernel_info{kernel,variant} of every role, 'role/kernel' -> variant (empty before the loader)."""
    out: dict[str, str] = {}
    for role, urls in server.roles.items():
        try:
            text = server.metrics(role)
        except (OSError, KeyError):
            continue
        for line in text.splitlines():
            if line.startswith("epd_kernel_info{") and line.rstrip().endswith(" 1.0"):
                labels = dict(part.split("=", 1) for part in line[len("epd_kernel_info{"):line.index("}")].split(","))
                out[f"{role}/{labels['kernel'].strip(chr(34))}"] = labels["variant"].strip('"')
        del urls
    return out


def judge(case: Case, levels: list[dict[str, Any]], output_len: int, kernels: dict[str, Any]) -> dict[str, Any]:
    rows = []
    for level in levels:
        sides = side_figures(level, output_len)
        a, b = sides["A"], sides["B"]
        c = level["concurrency"]
        if case.figure == "ttft":
            figure, gain = "TTFT p50", _minus_one(ratio(b["ttft_p50_ms"], a["ttft_p50_ms"]))
            on, off = a["ttft_p50_ms"], b["ttft_p50_ms"]
        elif c == 1:
            figure, gain = "TPOT p50", _minus_one(ratio(b["tpot_p50_ms"], a["tpot_p50_ms"]))
            on, off = a["tpot_p50_ms"], b["tpot_p50_ms"]
        else:
            figure, gain = "output tok/s", _minus_one(ratio(a["output_tok_s"], b["output_tok_s"]))
            on, off = a["output_tok_s"], b["output_tok_s"]
        rows.append({"concurrency": c, "figure": figure, "on": on, "off": off, "gain": gain, "sides": sides,
                     "failed": [a["failed"], b["failed"]]})
    best = max((row["gain"] for row in rows if row["gain"] is not None), default=None)
    return {"name": case.name, "what": case.what, "base": case.base, "off": case.b_text(), "image": case.image,
            "rows": rows, "best_gain": best, "keep": best is not None and best >= KEEP_GAIN,
            "commit": _commit(), "machine": machine(), "kernels": kernels}


def _failed(entry: dict[str, Any] | None) -> bool:
    return entry is None or any(sum(row["failed"]) for row in entry["rows"])


def _try_case(case: Case, quick: bool, levels: tuple[tuple[int, int], ...]) -> dict[str, Any] | None:
    """run_case, or None where a cluster did not start (a role killed for memory on the shared box)."""
    try:
        return run_case(case, quick, levels)
    except ServerError as exc:
        print(f"{case.name}: a cluster did not start ({str(exc).splitlines()[-1]})", flush=True)
        return None


def _minus_one(value: float | None) -> float | None:
    return None if value is None else value - 1.0


def _commit() -> str:
    """The commit measured: git's HEAD, or EPD_BENCH_COMMIT for a tree exported without its .git (a snapshot
    run while the checkout changes)."""
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or os.environ.get("EPD_BENCH_COMMIT", "unknown")


def table(doc: dict[str, Any]) -> str:
    lines = ["| kernel | what it does | figure | c=1 on / off | c=16 on / off | gain c=1 | gain c=16 | verdict | "
             "B (off) | measured at |", "|---|---|---|---|---|---|---|---|---|---|"]
    for entry in doc["cases"].values():
        rows = {row["concurrency"]: row for row in entry["rows"]}
        one, many = rows.get(1), rows.get(16) or rows.get(max(rows, default=0))
        figure = " / ".join(dict.fromkeys(row["figure"] for row in entry["rows"]))
        verdict = "kept" if entry["keep"] else "deleted"
        lines.append(f"| {entry['name']} | {entry['what']} | {figure} | {_pair(one)} | {_pair(many)} | "
                     f"{_gain(one)} | {_gain(many)} | **{verdict}** | {entry['off']} | "
                     f"{entry['commit']}, {entry['machine']['time']} (load {entry['machine']['loadavg_at_start']}), "
                     f"{'/'.join(str(n) for _, n in entry.get('levels', LEVELS))} requests a side"
                     f"{_earlier(entry)} |")
    return "\n".join(lines)


def _summary(entry: dict[str, Any]) -> dict[str, Any]:
    """What one run of a case read: its gains per concurrency, requests a side, commit and time."""
    return {"gains": {str(row["concurrency"]): row["gain"] for row in entry["rows"]},
            "levels": entry.get("levels", [list(level) for level in LEVELS]), "commit": entry["commit"],
            "time": entry["machine"]["time"], "keep": entry["keep"]}


def _earlier(entry: dict[str, Any]) -> str:
    runs = [f"{', '.join(f'c={c} {g * 100:+.0f}%' for c, g in run['gains'].items() if g is not None)} "
            f"({'/'.join(str(n) for _, n in run['levels'])} requests a side, {run['commit']})"
            for run in entry.get("earlier", [])]
    return f"; earlier: {'; '.join(runs)}" if runs else ""


def write_docs(doc: dict[str, Any]) -> None:
    body = (f"Generated by `python -m benchmarks.kernel_gains` from benchmarks/results/{JSON_NAME}; last command: "
            f"`{doc['command']}`. Each row: the commit and time it was measured at (2 CPUs shared with other jobs, A "
            f"and B alternating in rounds so the load falls on both); on = A, off = B, in ms for TTFT and TPOT, "
            f"tokens/s for output tok/s.\n\n{table(doc)}")
    replace_block(ROOT / "docs" / "benchmarks.md", "kernel-gains", body)


def _pair(row: dict[str, Any] | None) -> str:
    if row is None or row["on"] is None or row["off"] is None:
        return "n/a"
    return f"{row['on']:,.1f} / {row['off']:,.1f}"


def _gain(row: dict[str, Any] | None) -> str:
    return "n/a" if row is None or row["gain"] is None else f"{row['gain'] * 100:+.0f}%"


def main(argv: list[str] | None = None) -> int:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", help="comma-separated case names (default: all): " +
                        ", ".join(case.name for case in CASES))
    parser.add_argument("--quick", action="store_true", help="the tiny demo, a few requests (tests)")
    parser.add_argument("--no-docs", action="store_true")
    parser.add_argument("--levels", help="concurrency:requests,... (default 1:6,16:32)")
    parser.add_argument("--docs-only", action="store_true", help="rewrite the docs block from the JSON, run nothing")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    wanted = [name.strip() for name in (args.kernels or "").split(",") if name.strip()]
    unknown = set(wanted) - {case.name for case in CASES}
    if unknown:
        parser.error(f"unknown case(s) {sorted(unknown)}; known: {', '.join(case.name for case in CASES)}")
    levels = parse_levels(args.levels) or (QUICK_LEVELS if args.quick else LEVELS)
    path = results_dir(args.quick) / JSON_NAME
    doc = json.loads(path.read_text()) if path.exists() and not args.quick else {"cases": {}}
    for case in [] if args.docs_only else CASES:
        if wanted and case.name not in wanted:
            continue
        entry = _try_case(case, args.quick, levels)
        if _failed(entry):   # a role died (the shared box ran out of memory)
            print(f"{case.name}: requests failed, measuring it again", flush=True)
            entry = _try_case(case, args.quick, levels)
        if entry is None or _failed(entry):
            print(f"{case.name}: requests failed twice, not recorded", flush=True)
            continue
        print(json.dumps({k: entry[k] for k in ("name", "best_gain", "keep")}), flush=True)
        # every run is recorded with its levels: a case rerun with more requests replaces its row
        entry["command"] = " ".join(["python -m benchmarks.kernel_gains", *argv])
        entry["levels"] = [list(level) for level in levels]
        previous = doc["cases"].get(case.name)
        if previous is not None:   # the row shows the newest run, and what each earlier one read
            entry["earlier"] = [_summary(previous), *previous.get("earlier", [])][:3]
        doc["cases"][case.name] = entry
        doc["command"] = "python -m benchmarks.kernel_gains" + (f" --kernels {args.kernels}" if wanted else "")
        write_json(doc, path)
    print(table(doc))
    if not (args.quick or args.no_docs):
        write_docs(doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
