"""Orchestration overhead: epd's TTFT minus the compute its stages report, one request at a time.

For each one-image request (unique image, so encode runs) the script reads every role's
/metrics before and after it, so each request's own stage times are the counter deltas:

- compute = render (the render role's RenderChat time: template, tokenizer, image decoding
  and processing — it moves no tensors) + encode (`epd_stage_compute_seconds{stage="encode"}`,
  the vision forward) + prefill (`{stage="prefill"}`, the decoder forward);
- in-role transfers = (Encode RPC - encode forward) + (Prefill RPC - prefill forward): the
  EC put, EC get, KV put and the handlers;
- the rest: HTTP in and out, the coordinator's steps, four gRPC hops, decode's KV get.

TTFT is client-side: send -> the first chunk that carries the answer's token (max_tokens=1,
so a token whose text is empty still counts).  The coordinator's own TTFT
(`epd_coordinator_ttft_seconds`) is reported beside it.

    python -m benchmarks.overhead            # 60 requests on a fresh tiny cluster; docs block refreshed
    python -m benchmarks.overhead --quick    # 4 requests, docs untouched
    python -m benchmarks.overhead --model demo-medium   # the medium model's TTFT by stage (its own docs block)
    python -m benchmarks.overhead --model DIR --image-size 1024x768   # any checkpoint and image size (docs untouched)
    python -m benchmarks.overhead --compare-ref HEAD~1   # this tree vs another version, rounds alternating
                                                          # (and the CPU the five processes spend per request)

Target: <= 5 ms p50 on the one path (every hop one whole call: docs/architecture.md, "One path per hop").  Every
run writes its figures to benchmarks/results (overhead*.json; --quick: a scratch folder); the full run also writes
its figure and the breakdown (where the rest sits: each hop, the coordinator outside them, the client side)
between the `datapath-overhead` markers of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.common import Figure, machine, percentile, print_figures, results_dir, write_doc_block, write_json
from benchmarks.procs import Server, attach_epd, metric_sum, running, start_epd, tree_pids

# (role, metric, label filter) of every counter the script follows.
COUNTERS = {
    "render": ("render", "epd_rpc_seconds_sum", 'method="RenderChat"'),
    "encode_rpc": ("encode", "epd_rpc_seconds_sum", 'method="Encode"'),
    "encode": ("encode", "epd_stage_compute_seconds_sum", 'stage="encode"'),
    "prefill_rpc": ("prefill", "epd_rpc_seconds_sum", 'method="Prefill"'),
    "prefill": ("prefill", "epd_stage_compute_seconds_sum", 'stage="prefill"'),
    "coordinator_ttft": ("coordinator", "epd_coordinator_ttft_seconds_sum", ""),
    **{f"coordinator_{stage}": ("coordinator", "epd_coordinator_stage_seconds_sum", f'stage="{stage}"')
       for stage in ("render", "encode", "prefill")},
}


TARGET_MS = 5.0


@dataclass
class Sample:
    ttft_s: float
    stages: dict[str, float]

    @property
    def compute_s(self) -> float:
        return self.stages["render"] + self.stages["encode"] + self.stages["prefill"]

    @property
    def transfers_s(self) -> float:
        return (self.stages["encode_rpc"] - self.stages["encode"]) + (self.stages["prefill_rpc"]
                                                                       - self.stages["prefill"])


async def _scrape(session: aiohttp.ClientSession, server: Server) -> dict[str, float]:
    urls = {"coordinator": server.url, **{role: urls[0] for role, urls in server.roles.items()}}
    texts: dict[str, str] = {}
    for role in {role for role, _, _ in COUNTERS.values()}:
        async with session.get(urls[role] + "/metrics") as reply:
            texts[role] = await reply.text()
    return {name: metric_sum(texts[role], metric, labels) for name, (role, metric, labels) in COUNTERS.items()}


async def _first_token_s(session: aiohttp.ClientSession, url: str, body: bytes) -> float:
    """Send -> the first SSE chunk with content or a finish_reason (the answer's first token)."""
    started = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", data=body,
                            headers={"Content-Type": "application/json"}) as reply:
        if reply.status != 200:
            raise RuntimeError(f"HTTP {reply.status}: {(await reply.text())[:200]}")
        async for line in reply.content:
            if line.startswith(b"data: {") and _is_token_chunk(json.loads(line[6:])):
                elapsed = time.perf_counter() - started
                await reply.read()  # drain the rest of the stream so the connection is reused
                return elapsed
    raise RuntimeError("the stream ended without a token")


def _is_token_chunk(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or ():
        if (choice.get("delta") or {}).get("content") or choice.get("finish_reason"):
            return True
    return False


def _bodies(model: str, count: int, seed: int, image_size: tuple[int, int] = (224, 224)) -> list[bytes]:
    from services.bench import WorkloadConfig
    from services.bench.config import ImageSize
    from services.bench.workloads import make_workload

    workload = make_workload(WorkloadConfig(input_len=64, output_len=1, seed=seed,
                                            image_sizes=(ImageSize(*image_size),)))
    return [r.payload(model, {"temperature": 0.0}) for r in workload.build_many(0, count)]


async def measure(server: Server, model: str, count: int, warmup: int = 2,
                  image_size: tuple[int, int] = (224, 224)) -> list[Sample]:
    bodies = _bodies(model, count + warmup, random.randrange(1 << 30), image_size)  # new images: encode runs
    samples: list[Sample] = []
    async with aiohttp.ClientSession() as session:
        for i, body in enumerate(bodies):
            before = await _scrape(session, server)
            ttft = await _first_token_s(session, server.url, body)
            after = await _scrape(session, server)
            if i >= warmup:
                samples.append(Sample(ttft, {k: after[k] - before[k] for k in after}))
    return samples


def _tree_cpu_s(root: int) -> float:
    """CPU seconds every thread of `root` and its descendant processes has run (/proc/<pid>/task/*/schedstat:
    nanoseconds, where `process_cpu_seconds_total` counts 10 ms ticks)."""
    tree = tree_pids(root)
    total = 0
    for pid in tree:
        for task in Path(f"/proc/{pid}/task").glob("*/schedstat"):
            try:
                total += int(task.read_text().split()[0])
            except (OSError, IndexError, ValueError):
                continue
    return total / 1e9


async def cpu_per_request(server: Server, model: str, count: int,
                          image_size: tuple[int, int] = (224, 224)) -> float:
    """CPU seconds the cluster's processes (all five, render's image workers included) spent per request over
    `count` requests sent one at a time, read once before and once after (no scrape in between)."""
    bodies = _bodies(model, count + 2, random.randrange(1 << 30), image_size)
    async with aiohttp.ClientSession() as session:
        for body in bodies[:2]:
            await _first_token_s(session, server.url, body)
        before = _tree_cpu_s(server.process.pid)
        for body in bodies[2:]:
            await _first_token_s(session, server.url, body)
        return (_tree_cpu_s(server.process.pid) - before) / count


def summarize(samples: list[Sample]) -> dict[str, float]:
    def p50(values: list[float]) -> float:
        return percentile(values, 50) * 1e3

    return {"ttft_ms": p50([s.ttft_s for s in samples]),
            "coordinator_ttft_ms": p50([s.stages["coordinator_ttft"] for s in samples]),
            "compute_ms": p50([s.compute_s for s in samples]),
            **{f"{k}_ms": p50([s.stages[k] for s in samples]) for k in ("render", "encode", "prefill")},
            "transfers_and_handlers_ms": p50([s.transfers_s for s in samples]),
            "overhead_ms": p50([s.ttft_s - s.compute_s for s in samples]),
            "overhead_p90_ms": percentile([s.ttft_s - s.compute_s for s in samples], 90) * 1e3,
            "overhead_server_ms": p50([s.stages["coordinator_ttft"] - s.compute_s for s in samples]),
            "overhead_excl_transfers_ms": p50([s.ttft_s - s.compute_s - s.transfers_s for s in samples]),
            **breakdown(samples),
            "requests": len(samples)}


def breakdown(samples: list[Sample]) -> dict[str, float]:
    """Where the overhead sits (p50 ms): each gRPC hop seen from the coordinator minus the role's own
    time, the coordinator's time outside the three calls (decode open included), and the client side."""
    def p50(fn: Any) -> float:
        return percentile([fn(s.stages, s) for s in samples], 50) * 1e3

    return {
        "hop_render_ms": p50(lambda st, s: st["coordinator_render"] - st["render"]),
        "hop_encode_ms": p50(lambda st, s: st["coordinator_encode"] - st["encode_rpc"]),
        "hop_prefill_ms": p50(lambda st, s: st["coordinator_prefill"] - st["prefill_rpc"]),
        "coordinator_rest_ms": p50(lambda st, s: st["coordinator_ttft"] - st["coordinator_render"]
                                   - st["coordinator_encode"] - st["coordinator_prefill"]),
        "client_side_ms": p50(lambda st, s: s.ttft_s - st["coordinator_ttft"]),
    }


def figure_from(server: Server, model_name: str, count: int, label: str = "tiny model",
                image_size: tuple[int, int] = (224, 224)) -> Figure:
    samples = asyncio.run(measure(server, model_name, count, image_size=image_size))
    s = summarize(samples)
    return Figure(f"orchestration overhead: TTFT - stage compute, p50 ({label}, one at a time)",
                  s["overhead_ms"], TARGET_MS, "le", unit="ms", detail=s,
                  note=f"TTFT {s['ttft_ms']:.1f} ms = compute {s['compute_ms']:.1f} (render {s['render_ms']:.1f}, "
                       f"encode {s['encode_ms']:.1f}, prefill {s['prefill_ms']:.1f}) + overhead; of which "
                       f"in-role transfers {s['transfers_and_handlers_ms']:.1f}; server-side overhead "
                       f"{s['overhead_server_ms']:.1f} ms; {s['requests']} requests")


def run(quick: bool = False, server: Server | None = None, count: int | None = None,
        model: str = "demo", image_size: tuple[int, int] = (224, 224)) -> list[Figure]:
    count = count or (4 if quick else 60)
    label = ("tiny model" if model == "demo" else model) + (
        "" if image_size == (224, 224) else f", {image_size[0]}x{image_size[1]} image")
    if server is not None:
        return [figure_from(server, server.model_id(), count, label, image_size)]
    with running(start_epd(model)) as (epd,):
        return [figure_from(epd, epd.model_id(), count, label, image_size)]


def compare(ref: str, model: str, count: int, rounds: int = 6,
            image_size: tuple[int, int] = (224, 224)) -> list[Figure]:
    """This tree (A) and the version at git `ref` (B) as two clusters side by side, `count` requests each in
    `rounds` rounds alternating A B / B A (half of them with A started first, half with B); the overhead and
    TTFT p50 of each and their ratios."""
    from benchmarks.procs import tree_at

    per_round = max(1, count // rounds)
    tree = tree_at(ref)
    samples: dict[str, list[Sample]] = {"A": [], "B": []}
    cpu: dict[str, list[float]] = {"A": [], "B": []}
    # The cluster started first measured a few % slower compute and overhead with the same code on both sides
    # (2026-12-04): so each half of the rounds runs on a fresh pair, started in the other order.
    for half, first in enumerate(("A", "B")):
        starts = {"A": lambda: start_epd(model), "B": lambda: start_epd(model, root=tree)}
        order = (first, "B" if first == "A" else "A")
        with running(starts[order[0]]()) as (started,), running(starts[order[1]]()) as (second,):
            by_side = dict(zip(order, (started, second), strict=True))
            for index in range(half * rounds // 2, (half + 1) * rounds // 2):
                for side in (("A", "B") if index % 2 == 0 else ("B", "A")):
                    samples[side] += asyncio.run(measure(by_side[side], by_side[side].model_id(), per_round,
                                                         image_size=image_size))
            for side in order:   # the work itself: CPU per request, no scrape between the requests
                cpu[side].append(asyncio.run(cpu_per_request(by_side[side], by_side[side].model_id(),
                                                             max(20, count // 2), image_size)))
    s = {side: summarize(got) for side, got in samples.items()}
    spent = {side: 1e3 * sum(values) / len(values) for side, values in cpu.items()}
    figures = [Figure(f"CPU per request, all processes, this tree / {ref} ({model}, one at a time)",
                      spent["A"] / spent["B"], None, "le", unit="x", detail=spent,
                      note=f"{spent['A']:.2f} vs {spent['B']:.2f} ms of CPU per request")]
    for key, what in (("overhead_ms", "orchestration overhead p50"), ("ttft_ms", "TTFT p50"),
                      ("transfers_and_handlers_ms", "in-role transfers p50"), ("render_ms", "render p50"),
                      ("encode_ms", "encode compute p50"), ("prefill_ms", "prefill compute p50")):
        figures.append(Figure(f"{what}, this tree / {ref} ({model}, one at a time)", s["A"][key] / s["B"][key],
                              None, "le", unit="x", detail={"A": s["A"], "B": s["B"]},
                              note=f"{s['A'][key]:.2f} vs {s['B'][key]:.2f} ms; {s['A']['requests']} requests each, "
                                   f"{rounds} rounds alternating"))
    return figures


def breakdown_text(detail: dict[str, float]) -> str:
    """The breakdown as one line of p50s (each taken on its own: they need not add up)."""
    parts = {"render hop": "hop_render_ms", "encode hop": "hop_encode_ms", "prefill hop": "hop_prefill_ms",
             "coordinator outside the three calls (decode open included)": "coordinator_rest_ms",
             "client side (HTTP in and out)": "client_side_ms", "in-role transfers": "transfers_and_handlers_ms"}
    return "Where the overhead sits (p50 ms, each on its own): " + "; ".join(
        f"{name} {detail[key]:.2f}" for name, key in parts.items()) + "."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--epd-url", help="measure a running tiny-model cluster instead of starting one")
    parser.add_argument("--requests", type=int, help="measured requests (default 60, quick 4)")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md")
    parser.add_argument("--model", default="demo",
                        help="model to serve (default demo, the tiny one; demo-medium: the medium model's TTFT "
                             "by stage, into its own docs block)")
    parser.add_argument("--image-size", default="224x224", help="WxH of each request's image (docs untouched "
                        "unless 224x224)")
    parser.add_argument("--compare-ref", metavar="REF",
                        help="measure this tree against the version at git REF side by side (docs untouched)")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    width, _, height = args.image_size.partition("x")
    image_size = (int(width), int(height))
    if args.compare_ref:
        figures = compare(args.compare_ref, args.model, args.requests or (8 if args.quick else 60),
                          rounds=2 if args.quick else 6, image_size=image_size)
        print_figures(figures, f"this tree vs {args.compare_ref}")
        write_json({"command": " ".join(["python -m benchmarks.overhead", *argv]), "machine": machine(),
                    "figures": figures}, results_dir(args.quick) / f"overhead_compare_{args.model}.json")
        return 0
    server = attach_epd(args.epd_url) if args.epd_url else None
    figures = run(args.quick, server, args.requests, args.model, image_size)
    print_figures(figures, "orchestration overhead")
    print(json.dumps(figures[0].detail, indent=1))
    name = "overhead.json" if args.model == "demo" else f"overhead_{args.model}.json"
    write_json({"command": " ".join(["python -m benchmarks.overhead", *argv]), "machine": machine(),
                "figures": figures}, results_dir(args.quick or bool(args.epd_url)) / name)
    if not (args.quick or args.no_docs or args.epd_url or image_size != (224, 224)):
        block = "datapath-overhead" if args.model == "demo" else f"datapath-overhead-{args.model}"
        write_doc_block(block, " ".join(["python -m benchmarks.overhead", *argv]), figures,
                        breakdown_text(figures[0].detail))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
