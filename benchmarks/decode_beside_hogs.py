"""Why decode's TPOT rises beside a long prefill: decode's streams beside synthetic neighbours at the priority
`epd serve` gives a long prompt's prefill (its own session, autogroup niceness 19, niceness 19).

    python -m benchmarks.decode_beside_hogs            # medium demo model, 8 streams, 2 rounds of each neighbour
    python -m benchmarks.decode_beside_hogs --quick    # tiny model, one round (docs untouched)

One epd cluster (`epd serve`, decode's niceness at `decode-long`'s 5, as while a long prompt prefills).  8 greedy
streams decode throughout; windows alternate "alone" and "beside a neighbour":

- spin: two processes that only spin (no memory traffic, no caches): what the CPU scheduler alone costs;
- memory: two processes copying 200 MB arrays (memory bandwidth and the shared L3, little arithmetic);
- gemm: one process running float32 GEMMs on two torch threads (what a prefill chunk is).

The streams' context grows during the run, so each "beside" window is compared with the mean of the "alone"
windows right before and after it.  Figure: TPOT p50 beside / alone, per neighbour (the median over rounds).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from typing import Any

from benchmarks.common import Figure, machine, median, print_figures, results_dir, write_doc_block, write_json
from benchmarks.procs import exit_on_sigterm, running, start_epd
from benchmarks.tpot_under_prefill import Stream, ids, stream_tokens

# each neighbour leads its own session (Popen start_new_session), so its autogroup is its own
_PRIORITY = "import os\nopen('/proc/self/autogroup', 'w').write('19')\nos.nice(19)\n"
NEIGHBOURS: dict[str, tuple[int, str]] = {   # name -> (processes, code)
    "spin": (2, "while True:\n    pass\n"),
    "memory": (2, "import numpy as np\na = np.ones(50_000_000, dtype=np.float32)\nb = np.empty_like(a)\n"
                  "while True:\n    np.copyto(b, a)\n"),
    "gemm": (1, "import torch\ntorch.set_num_threads(2)\nx, w = torch.randn(512, 1024), torch.randn(2816, 1024)\n"
                "while True:\n    torch.nn.functional.linear(x, w)\n"),
}
SETTLE_S = 1.5   # after a neighbour starts or stops, before a window opens


def _start(name: str) -> list[subprocess.Popen]:
    count, code = NEIGHBOURS[name]
    return [subprocess.Popen([sys.executable, "-c", _PRIORITY + code], start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(count)]


async def _window(streams: list[Stream], seconds: float) -> float:
    await asyncio.sleep(SETTLE_S)
    start = time.perf_counter()
    await asyncio.sleep(seconds)
    return median([s.tpot_ms(start, time.perf_counter()) for s in streams])


async def measure(url: str, model: str, rounds: int, window_s: float, streams_n: int = 8) -> dict[str, Any]:
    from services.bench.client import new_session

    streams = [Stream() for _ in range(streams_n)]
    plan = [name for _ in range(rounds) for name in NEIGHBOURS]
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in NEIGHBOURS}
    async with new_session(3600) as session:
        tasks = [asyncio.create_task(stream_tokens(session, url, model, ids(64, 900 + i), 4000, stream))
                 for i, stream in enumerate(streams)]
        try:
            while min(len(s.times) for s in streams) < 4:
                await asyncio.sleep(0.05)
            before = await _window(streams, window_s)
            for name in plan:
                neighbours = _start(name)
                try:
                    beside = await _window(streams, window_s)
                finally:
                    for process in neighbours:
                        process.kill()
                        process.wait()
                after = await _window(streams, window_s)
                samples[name].append({"beside_ms": beside, "alone_ms": (before + after) / 2})
                before = after
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return samples


def figures_of(samples: dict[str, list[dict[str, float]]]) -> list[Figure]:
    out = []
    for name, rows in samples.items():
        ratios = [r["beside_ms"] / r["alone_ms"] for r in rows]
        count, _ = NEIGHBOURS[name]
        out.append(Figure(f"decode TPOT p50 beside {count} '{name}' neighbour(s) at nice 19 / alone", median(ratios),
                          None, "le", note=", ".join(f"{r['beside_ms']:.1f} vs {r['alone_ms']:.1f} ms" for r in rows)))
    return out


def main(argv: list[str] | None = None) -> int:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, one round, docs untouched")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args(argv)
    from services.models.demo import demo_model_path

    model = "tiny" if args.quick else "medium"
    rounds, window_s = args.rounds or (1 if args.quick else 2), 1.0 if args.quick else 5.0
    where = machine()
    flags = ["--role-nice=decode=5"] + (["--linear-kernel", "default"] if args.quick else [])
    with running(start_epd(str(demo_model_path(model)), *flags)) as (server,):
        samples = asyncio.run(measure(server.url, server.model_id(), rounds, window_s))
    figures = figures_of(samples)
    print_figures(figures, f"decode beside synthetic neighbours ({model} model, 8 streams)")
    write_json({"figures": figures, "samples": samples, "machine": where, "model": model, "flags": flags},
               results_dir(args.quick) / "decode_beside_hogs.json")
    if not args.quick and not args.no_docs:
        write_doc_block("decode-beside-hogs", "python -m benchmarks.decode_beside_hogs", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
