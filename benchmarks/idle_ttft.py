"""TTFT at c=1 when requests arrive after a pause: back to back, after 0.1 s and after 1 s of idling.

Why: the overhead and trace benchmarks send requests back to back, but a request that finds the machine
idle meets cold cores.  On this VM a two-thread forward after its cores idled a few tens of milliseconds
pays a sleeping OpenMP worker's wake-up at each of its parallel regions (the tiny model's vision forward:
1.6 ms back to back, 11.8 ms after 0.1 s), which is why small forwards run on one thread
(services/models/forward_cost.py, compute_threads.use_for).

    python -m benchmarks.idle_ttft                      # tiny model, 8 requests per pause
    python -m benchmarks.idle_ttft --compare-ref REF    # this tree and the version at REF, alternating
    python -m benchmarks.idle_ttft --model DIR --quick  # any checkpoint; 3 requests per pause
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import aiohttp

from benchmarks.common import Figure, percentile, print_figures
from benchmarks.overhead import _bodies, _first_token_s
from benchmarks.procs import Server, running, start_epd

PAUSES_S = (0.0, 0.1, 1.0)


async def _ttfts(server: Server, pause_s: float, count: int) -> list[float]:
    bodies = _bodies(server.model_id(), count + 1, random.randrange(1 << 30))  # new images: encode runs
    out = []
    async with aiohttp.ClientSession() as session:
        await _first_token_s(session, server.url, bodies[0])  # the connection and the cluster are up
        for body in bodies[1:]:
            await asyncio.sleep(pause_s)
            out.append(await _first_token_s(session, server.url, body) * 1e3)
    return out


def measure(servers: dict[str, Server], count: int, rounds: int = 2) -> dict[str, dict[float, list[float]]]:
    """TTFTs (ms) per side and pause; sides alternate within each round, the order flipping between rounds."""
    got: dict[str, dict[float, list[float]]] = {side: {p: [] for p in PAUSES_S} for side in servers}
    per_round = max(1, count // rounds)
    for index in range(rounds):
        for pause in PAUSES_S:
            for side in (list(servers) if index % 2 == 0 else list(reversed(servers))):
                time.sleep(1.0)  # the other side's last request is over and idle
                got[side][pause] += asyncio.run(_ttfts(servers[side], pause, per_round))
    return got


def figures(got: dict[str, dict[float, list[float]]], label: str) -> list[Figure]:
    out = []
    for pause in PAUSES_S:
        values = {side: percentile(times[pause], 50) for side, times in got.items()}
        note = ", ".join(f"{side} {value:.1f} ms" for side, value in values.items())
        if len(values) == 2:
            a, b = values.values()
            out.append(Figure(f"TTFT p50 after {pause:g} s idle, this tree / {label}", a / b, None, unit="x",
                              note=f"{note}; {len(got['A'][pause])} requests each", detail=values))
        else:
            out.append(Figure(f"TTFT p50 after {pause:g} s idle ({label})", values["A"], None, unit="ms",
                              note=f"{len(got['A'][pause])} requests", detail=values))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", default="demo")
    parser.add_argument("--requests", type=int, help="requests per pause and side (default 8, quick 3)")
    parser.add_argument("--compare-ref", metavar="REF", help="also run the version at git REF, alternating")
    args = parser.parse_args(argv)
    count = args.requests or (3 if args.quick else 8)
    if args.compare_ref:
        from benchmarks.procs import tree_at

        tree = tree_at(args.compare_ref)
        with running(start_epd(args.model), start_epd(args.model, root=tree)) as (a, b):
            got = measure({"A": a, "B": b}, count)
        print_figures(figures(got, args.compare_ref), "TTFT after idling, side by side")
    else:
        with running(start_epd(args.model)) as (a,):
            got = measure({"A": a}, count, rounds=1)
        print_figures(figures(got, args.model), "TTFT after idling")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
