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

from benchmarks import engine_targets
from benchmarks.common import ROOT, Figure, machine, print_figures, ratio, results_dir, write_json
from benchmarks.peer import check_same_prompt, peer_extra_body, peer_folder
from benchmarks.procs import start_epd, start_transformers_serve
from benchmarks.side_by_side import Servers, Workload, level_rows, parse_levels, run_levels, side_figures

DOC = ROOT / "docs" / "benchmarks.md"
IMG = ROOT / "docs" / "img"


@dataclass(frozen=True)
class SideBySide(Workload):
    cb_num_blocks: int = 512
    cb_max_batch_tokens: int = 2048

    @classmethod
    def quick(cls) -> SideBySide:
        return cls(model="tiny", levels=((4, 8),), input_len=32, output_len=8, warmup=1)


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


def figures(doc: dict[str, Any], setup: SideBySide) -> list[Figure]:
    """The targets at the highest concurrency level (epd / peer): issue 10's >= 5x output tokens/s, and
    issue 4's p50 TTFT <= 0.7x."""
    level = doc["levels"][-1]
    sides = side_figures(level, setup.output_len)
    epd, peer = sides["A"], sides["B"]
    c = level["concurrency"]
    what = f"c{c}, one {setup.image_size[0]}x{setup.image_size[1]} image, {setup.model} model"
    return [
        Figure(f"output tokens/s, epd vs transformers serve ({what})",
               ratio(epd["output_tok_s"], peer["output_tok_s"]), 5.0, "ge",
               detail=sides, note=f"{epd['output_tok_s']:.1f} vs {peer['output_tok_s']:.1f} tok/s"),
        Figure(f"p50 TTFT, epd / transformers serve ({what})",
               ratio(epd["ttft_p50_ms"], peer["ttft_p50_ms"]), 0.7, "le",
               detail=sides, note=f"{epd['ttft_p50_ms']:.0f} vs {peer['ttft_p50_ms']:.0f} ms"),
    ]


def markdown(doc: dict[str, Any], setup: SideBySide, probe: dict[str, Any], command: str) -> str:
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
        *level_rows(doc, setup.output_len),
        "",
        cdfs,
        "",
        "![throughput and p99 TTFT against concurrency](img/vs_transformers_serve_sweep.png)",
    ])


def run(setup: SideBySide, servers: Servers | None = None, plots: Path | None = None
        ) -> tuple[list[Figure], dict[str, Any]]:
    """Start (unless given) both servers, check the prompt, run every level; returns figures + document."""
    own, where = servers is None, machine()
    servers = servers or start_both(setup)
    try:
        probe = check_same_prompt(servers.epd.url, servers.epd_model, servers.peer.url, servers.peer_model)
        doc = run_levels(servers, setup, peer_extra_body(setup.output_len), plots, "vs_transformers_serve")
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
                                 "levels": parse_levels(args.levels)}.items() if v is not None}
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
    engine_targets.write_table()


if __name__ == "__main__":
    raise SystemExit(main())
