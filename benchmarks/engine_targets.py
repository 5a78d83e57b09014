"""Issue 10's targets table, generated from the JSON the benchmark scripts wrote (never by hand).

    python -m benchmarks.engine_targets      # rewrite the `engine-targets` block of docs/benchmarks.md

Each target names the script that measures it and how its figure is found in that script's
results file (benchmarks/results/<file>.json, a `figures` list); a target whose file or figure
is missing shows "not measured" and the command that measures it.  Each row keeps when it was
measured and the load average then, and says by how much a missed target is missed.  The
scripts of this repo call `write_table()` themselves after a full run, so the table follows
their last results.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, ROOT, Figure, format_value, replace_block

DOC = ROOT / "docs" / "benchmarks.md"


@dataclass(frozen=True)
class Target:
    label: str
    target: float
    op: str                              # "ge" | "le"
    results: str                         # results file stem
    command: str
    matches: Callable[[str], bool]       # picks the figure by name


def _all(*words: str) -> Callable[[str], bool]:
    return lambda name: all(word in name for word in words)


TARGETS = (
    Target("output tok/s, medium, one image, c=16, epd / vLLM CPU (stretch 1.5x)", 1.0, "ge", "vs_vllm",
           "python -m benchmarks.vs_vllm", _all("output tok/s, c16", "vLLM")),
    Target("TPOT p50, same, epd / vLLM CPU", 1.0, "le", "vs_vllm", "python -m benchmarks.vs_vllm",
           _all("TPOT p50, c16", "vLLM")),
    Target("TTFT p50, medium, one image, c=1, epd / vLLM CPU", 1.0, "le", "vs_vllm",
           "python -m benchmarks.vs_vllm", _all("TTFT p50, c1,", "vLLM")),
    Target("output tok/s, SmolLM2 text, c=1, epd / llama.cpp F32", 0.8, "ge", "vs_llama_cpp",
           "python -m benchmarks.vs_llama_cpp", _all("output tokens/s, SmolLM2 text c=1,", "llama.cpp")),
    Target("output tok/s, SmolLM2 text, c=16, epd / llama.cpp F32", 1.2, "ge", "vs_llama_cpp",
           "python -m benchmarks.vs_llama_cpp", _all("output tokens/s, SmolLM2 text c=16,", "llama.cpp")),
    Target("decode TPOT p50 while a 4k-token prompt prefills beside 8 streams, vs without", 1.3, "le",
           "tpot_under_prefill", "python -m benchmarks.tpot_under_prefill", _all("decode TPOT p50 while")),
    Target("KV memory held / (tokens held x bytes per token), 16 streams of mixed lengths", 1.1, "le",
           "kv_memory", "python -m benchmarks.kv_memory --model medium", _all("KV memory held")),
    Target("output tok/s, medium, c=16, epd / `transformers serve`", 5.0, "ge", "vs_transformers_serve",
           "python -m benchmarks.vs_transformers_serve", _all("output tokens/s, epd vs transformers serve")),
)


def find(target: Target, folder: Path) -> tuple[Figure | None, dict[str, Any]]:
    """The target's figure in its results file (or None), and the file's machine record."""
    path = folder / f"{target.results}.json"
    if not path.exists():
        return None, {}
    doc = json.loads(path.read_text())
    if "figures" not in doc and "max_ratio" in doc.get("result", {}):  # kv_memory.py keeps its raw result
        result = doc["result"]
        return Figure(target.label, result["max_ratio"], target.target, target.op,
                      note=f"worst of {result.get('samples', '?')} samples"), _machine(doc)
    for raw in doc.get("figures", []):
        if target.matches(raw["name"]):
            figure = Figure(**{k: raw.get(k) for k in ("name", "value", "target", "op", "unit", "detail", "note")})
            return figure, _machine(doc)
    return None, _machine(doc)


def _machine(doc: dict[str, Any]) -> dict[str, Any]:
    bench = doc.get("bench") or {}
    for where in (doc.get("machine"), bench.get("side_by_side", {}).get("machine"), bench.get("machine")):
        if where:
            return where
    return {}


def verdict(value: float | None, target: float, op: str) -> str:
    if value is None:
        return "not measured"
    met = value >= target if op == "ge" else value <= target
    if met:
        return "met"
    return f"MISSED by {abs(value / target - 1):.0%}"


def rows(folder: Path = RESULTS_DIR) -> list[str]:
    out = ["| figure | target | measured | verdict | details | command | measured at (load avg 1/5/15 min) |",
           "|---|---|---|---|---|---|---|"]
    for target in TARGETS:
        figure, where = find(target, folder)
        value = figure.value if figure else None
        sign = ">=" if target.op == "ge" else "<="
        when = f"{where.get('time', '-')} ({', '.join(str(x) for x in where.get('loadavg_at_start', []))})" \
            if where else "-"
        out.append(f"| {target.label} | {sign} {target.target:.2f}x | {format_value(value)} | "
                   f"{verdict(value, target.target, target.op)} | {(figure.note if figure else '') or '-'} | "
                   f"`{target.command}` | {when} |")
    return out


def write_table(folder: Path = RESULTS_DIR, doc: Path = DOC) -> None:
    body = ("Generated by `python -m benchmarks.engine_targets` from `benchmarks/results/*.json` (never edited by "
            "hand); each script refreshes it after a full run. Every ratio was measured in one run of its script, "
            "alternating epd and the baseline.\n\n" + "\n".join(rows(folder)))
    replace_block(doc, "engine-targets", body)


def main() -> int:
    write_table()
    print("\n".join(rows()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
