"""epd vs `transformers serve` on the same checkpoint folder, in one interleaved run.

    python -m benchmarks.vs_transformers_serve            # medium demo model, ~10 minutes
    python -m benchmarks.vs_transformers_serve --quick    # tiny model, a few requests

Starts `epd serve --model FOLDER` and `transformers serve FOLDER --continuous-batching` (its
KV cache bounded by --cb-num-blocks / --cb-max-batch-tokens) on the same demo checkpoint,
proves both see the same prompt (`peer.check_same_prompt`: equal prompt_tokens for an image
request, same greedy text), then runs the same one-image workload against both with
`epd bench --compare` machinery (rounds alternate A B / B A) at each concurrency level.
Both answer greedily with exactly `output_len` tokens (epd: ignore_eos; the peer: a
generation config without EOS), so output tokens/s is completed x output_len / duration on
both sides (the peer reports no usage when streaming).  Writes benchmarks/results/
vs_transformers_serve.json, docs/img/vs_transformers_serve_*.png and the table in
docs/benchmarks.md (unless --no-docs).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, Figure, machine, print_figures, ratio, results_dir, write_json
from benchmarks.peer import check_same_prompt, peer_extra_body, peer_folder
from benchmarks.procs import Server, start_epd, start_transformers_serve

DOC = ROOT / "docs" / "benchmarks.md"
IMG = ROOT / "docs" / "img"


@dataclass(frozen=True)
class SideBySide:
    model: str = "medium"                       # demo size
    levels: tuple[tuple[int, int], ...] = ((1, 6), (16, 32))   # (concurrency, requests per side)
    input_len: int = 64
    output_len: int = 64
    image_size: tuple[int, int] = (224, 224)
    warmup: int = 2
    cb_num_blocks: int = 512
    cb_max_batch_tokens: int = 2048
    threads: int | None = None                  # OMP threads per process (None: torch's default)

    @classmethod
    def quick(cls) -> SideBySide:
        return cls(model="tiny", levels=((4, 8),), input_len=32, output_len=8, warmup=1)


@dataclass
class Servers:
    epd: Server
    peer: Server
    epd_model: str
    peer_model: str

    def stop(self) -> None:
        self.epd.stop()
        self.peer.stop()


def start_both(setup: SideBySide) -> Servers:
    """Both servers on the same checkpoint, started side by side (startup is minutes on this CPU)."""
    from services.models.demo import demo_model_path

    checkpoint = demo_model_path(setup.model)
    folder = peer_folder(checkpoint)
    started: dict[str, Any] = {}

    def peer() -> None:
        try:
            started["peer"] = start_transformers_serve(
                folder, "--continuous-batching", "--cb-num-blocks", str(setup.cb_num_blocks),
                "--cb-max-batch-tokens", str(setup.cb_max_batch_tokens), threads=setup.threads)
        except Exception as exc:  # re-raised below, after epd is up or failed too
            started["peer_error"] = exc

    thread = threading.Thread(target=peer)
    thread.start()
    try:
        epd = start_epd(str(checkpoint), threads=setup.threads)
    finally:
        thread.join()
    if "peer_error" in started:
        epd.stop()
        raise started["peer_error"]
    return Servers(epd, started["peer"], checkpoint.name, str(folder))


def bench_config(servers: Servers, setup: SideBySide, concurrency: int, requests: int) -> Any:
    from services.bench import BenchConfig, Endpoint, LoadConfig, WorkloadConfig
    from services.bench.config import ImageSize

    width, height = setup.image_size
    return BenchConfig(
        endpoints=(Endpoint(servers.epd.url, model=servers.epd_model, label="A",
                            metrics_urls=tuple(servers.epd.metrics_urls()), extra_body={"temperature": 0.0}),
                   Endpoint(servers.peer.url, model=servers.peer_model, label="B",
                            extra_body=peer_extra_body(setup.output_len))),
        workload=WorkloadConfig(input_len=setup.input_len, output_len=setup.output_len,
                                image_sizes=(ImageSize(width, height),), seed=concurrency),
        load=LoadConfig(concurrency=concurrency, num_requests=requests, warmup=setup.warmup, timeout_s=1800),
        # Rounds of one concurrency's worth of requests: A B, B A, ... so the two sides alternate.
        round_size=concurrency if requests >= 2 * concurrency else requests, show_progress=False)


def run_levels(servers: Servers, setup: SideBySide, plots: Path | None) -> dict[str, Any]:
    """One compare run per level (latency CDFs into `plots`); returns one epd-bench/1 document."""
    from services.bench import run_bench
    from services.bench.plots import latency_cdfs
    from services.bench.report import to_json

    doc: dict[str, Any] | None = None
    for concurrency, requests in setup.levels:
        outcome = run_bench(bench_config(servers, setup, concurrency, requests))
        if plots is not None:
            plots.mkdir(parents=True, exist_ok=True)
            latency_cdfs(outcome.levels[0], str(plots / f"vs_transformers_serve_cdf_c{concurrency}.png"))
        level_doc = to_json(outcome)
        if doc is None:
            doc = level_doc
        else:
            doc["levels"].extend(level_doc["levels"])
    assert doc is not None
    return doc


def side_figures(level: dict[str, Any], output_len: int) -> dict[str, dict[str, float | None]]:
    """Per side: output tok/s (completed x output_len / duration), TTFT p50/p99, TPOT p50, failures."""
    out: dict[str, dict[str, float | None]] = {}
    for label, summary in level["results"].items():
        duration = summary.get("duration_s") or 0.0
        out[label] = {"output_tok_s": summary["completed"] * output_len / duration if duration else None,
                      "ttft_p50_ms": (summary.get("ttft_ms") or {}).get("p50"),
                      "ttft_p99_ms": (summary.get("ttft_ms") or {}).get("p99"),
                      "tpot_p50_ms": (summary.get("tpot_ms") or {}).get("p50"),
                      "e2el_p50_ms": (summary.get("e2el_ms") or {}).get("p50"),
                      "completed": summary["completed"], "failed": summary["failed"],
                      "output_tokens_counted": summary.get("output_tokens")}
    return out


def figures(doc: dict[str, Any], setup: SideBySide) -> list[Figure]:
    """The two section-4 targets at the highest concurrency level (epd / peer)."""
    level = doc["levels"][-1]
    sides = side_figures(level, setup.output_len)
    epd, peer = sides["A"], sides["B"]
    c = level["concurrency"]
    what = f"c{c}, one {setup.image_size[0]}x{setup.image_size[1]} image, {setup.model} model"
    return [
        Figure(f"output tokens/s, epd vs transformers serve ({what})",
               ratio(epd["output_tok_s"], peer["output_tok_s"]), 3.0, "ge",
               detail=sides, note=f"{epd['output_tok_s']:.1f} vs {peer['output_tok_s']:.1f} tok/s"),
        Figure(f"p50 TTFT, epd / transformers serve ({what})",
               ratio(epd["ttft_p50_ms"], peer["ttft_p50_ms"]), 0.7, "le",
               detail=sides, note=f"{epd['ttft_p50_ms']:.0f} vs {peer['ttft_p50_ms']:.0f} ms"),
    ]


def markdown(doc: dict[str, Any], setup: SideBySide, probe: dict[str, Any], command: str) -> str:
    rows = ["| concurrency | requests/side | epd tok/s | peer tok/s | tok/s epd/peer | epd TTFT p50 (ms) | "
            "peer TTFT p50 (ms) | TTFT epd/peer | epd TPOT p50 (ms) | peer TPOT p50 (ms) | failed epd/peer |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for level in doc["levels"]:
        s = side_figures(level, setup.output_len)
        a, b = s["A"], s["B"]
        rows.append(f"| {level['concurrency']} | {a['completed']} | {_f(a['output_tok_s'])} | {_f(b['output_tok_s'])} "
                    f"| {_x(ratio(a['output_tok_s'], b['output_tok_s']))} | {_f(a['ttft_p50_ms'], 0)} | "
                    f"{_f(b['ttft_p50_ms'], 0)} | {_x(ratio(a['ttft_p50_ms'], b['ttft_p50_ms']))} | "
                    f"{_f(a['tpot_p50_ms'], 0)} | {_f(b['tpot_p50_ms'], 0)} | {a['failed']}/{b['failed']} |")
    image = probe["image"]
    where = doc["side_by_side"]["machine"]
    cdfs = " ".join(f"![latency CDFs c{c}](img/vs_transformers_serve_cdf_c{c}.png)" for c, _ in setup.levels)
    return "\n".join([
        f"Command: `{command}` ({where['time']}, {where['cpus']} CPUs shared with other jobs, load average "
        f"at start {where['loadavg_at_start']}).",
        "",
        f"Workload: {setup.input_len} words + one {setup.image_size[0]}x{setup.image_size[1]} JPEG per request, "
        f"{setup.output_len} output tokens (greedy, no EOS on either side), {setup.model} demo model; A = epd "
        f"(1 render, 1 encode, 1 prefill, 1 decode with 16 slots, shm connectors), B = `transformers serve "
        f"--continuous-batching --cb-num-blocks {setup.cb_num_blocks} --cb-max-batch-tokens "
        f"{setup.cb_max_batch_tokens}`. Same prompt check: image request prompt_tokens epd "
        f"{image['epd_prompt_tokens']} / peer {image['peer_prompt_tokens']}, same greedy text (ignoring the "
        f"leading space the peer strips): {image['same_text']}.",
        "",
        *rows,
        "",
        cdfs,
        "",
        "![throughput and p99 TTFT against concurrency](img/vs_transformers_serve_sweep.png)",
    ])


def _f(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def run(setup: SideBySide, servers: Servers | None = None, plots: Path | None = None
        ) -> tuple[list[Figure], dict[str, Any]]:
    """Start (unless given) both servers, check the prompt, run every level; returns figures + document."""
    own, where = servers is None, machine()
    servers = servers or start_both(setup)
    try:
        probe = check_same_prompt(servers.epd.url, servers.epd_model, servers.peer.url, servers.peer_model)
        doc = run_levels(servers, setup, plots)
        peer_log = servers.peer.log_tail(400)
    finally:
        if own:
            servers.stop()
    doc["side_by_side"] = {"setup": dataclasses.asdict(setup), "probe": probe, "machine": where,
                           "peer_fell_back_to_sequential": "Falling back to sequential generation" in peer_log}
    return figures(doc, setup), doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, a few requests")
    parser.add_argument("--model", choices=("tiny", "medium"))
    parser.add_argument("--levels", help="concurrency:requests,... (default 1:6,16:32)")
    parser.add_argument("--output-len", type=int)
    parser.add_argument("--threads", type=int, help="OMP threads per server process")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md and docs/img")
    parser.add_argument("--tag", default="", help="suffix of the results file (variants of the main run)")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    setup = SideBySide.quick() if args.quick else SideBySide()
    changes = {k: v for k, v in {"model": args.model, "output_len": args.output_len, "threads": args.threads,
                                 "levels": _levels(args.levels)}.items() if v is not None}
    setup = replace(setup, **changes)
    figs, doc = run(setup, plots=None if args.no_docs else IMG)
    print_figures(figs, "epd vs transformers serve")
    name = "vs_transformers_serve" + ("_quick" if args.quick else "") + (f"_{args.tag}" if args.tag else "")
    write_json({"figures": figs, "bench": doc}, results_dir(args.quick) / f"{name}.json")
    if not args.no_docs:
        write_docs(doc, setup, "python -m benchmarks.vs_transformers_serve " + " ".join(argv))
    return 0


def write_docs(doc: dict[str, Any], setup: SideBySide, command: str) -> None:
    from benchmarks.common import replace_block
    from services.bench.plots import sweep

    if len(doc["levels"]) > 1:
        sweep(doc, str(IMG / "vs_transformers_serve_sweep.png"))
    replace_block(DOC, "vs-transformers-serve", markdown(doc, setup, doc["side_by_side"]["probe"], command.strip()))


def _levels(text: str | None) -> tuple[tuple[int, int], ...] | None:
    if not text:
        return None
    return tuple((int(c), int(n)) for c, n in (part.split(":") for part in text.split(",")))


if __name__ == "__main__":
    raise SystemExit(main())
