"""Image reuse: 80% vs 0% of images seen before, on one cluster, in alternating halves.

Each condition runs `halves` times, alternating (0%, 80%, 80%, 0%, ...) so machine noise
falls on both; every half has its own workload seed, so a half never finds another half's
images.  An 80% half of N one-image requests draws from a pool of N/5 images (`epd bench
--image-pool`): N/5 distinct images, 80% of items repeats.  Figures:

- encoder calls (`epd_encode_items_total{result="encoded"}`, items that ran the vision tower)
  = the number of distinct images sent, in both conditions;
- p50 TTFT at 80% reuse / at 0% reuse.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from benchmarks.common import Figure, percentile, print_figures, ratio
from benchmarks.procs import Server, attach_epd, running, start_epd


@dataclass(frozen=True)
class ReuseSetup:
    model: str = "medium"
    requests_per_half: int = 20
    halves: int = 2
    concurrency: int = 4
    input_len: int = 64
    output_len: int = 16
    reuse: float = 0.8

    @classmethod
    def quick(cls) -> ReuseSetup:
        return cls(model="tiny", requests_per_half=10, halves=1, concurrency=4, output_len=2)

    @property
    def pool(self) -> int:
        return max(1, round(self.requests_per_half * (1 - self.reuse)))


def _half(server: Server, setup: ReuseSetup, pool: int, seed: int) -> dict[str, Any]:
    from services.bench import BenchConfig, Endpoint, LoadConfig, WorkloadConfig, run_bench
    from services.bench.report import to_json

    config = BenchConfig(
        endpoints=(Endpoint(server.url, metrics_urls=tuple(server.metrics_urls()), extra_body={"temperature": 0.0}),),
        workload=WorkloadConfig(input_len=setup.input_len, output_len=setup.output_len, image_pool=pool, seed=seed),
        load=LoadConfig(concurrency=setup.concurrency, num_requests=setup.requests_per_half, timeout_s=1800),
        show_progress=False, save_requests=True)
    return to_json(run_bench(config))["levels"][0]["results"]["A"]


def measure(server: Server, setup: ReuseSetup, seed: int = 1000) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {"0%": [], "80%": []}
    order = ["0%", "80%"]
    for half in range(setup.halves):
        for name in order if half % 2 == 0 else order[::-1]:
            pool = 0 if name == "0%" else setup.pool
            runs[name].append(_half(server, setup, pool, seed + 17 * len(runs["0%"] + runs["80%"])))
    return runs


def _combined(halves: list[dict[str, Any]]) -> dict[str, Any]:
    ttfts = [r["ttft_ms"] for h in halves for r in h["requests"] if r["ok"] and r["ttft_ms"] is not None]
    encoded = [(h.get("encoder_cache") or {}).get("encoded") for h in halves]
    return {"ttft_p50_ms": percentile(ttfts, 50), "ttft_p90_ms": percentile(ttfts, 90),
            "images": sum(h["images"]["images"] for h in halves),
            "distinct_images": sum(h["images"]["distinct_images"] for h in halves),
            "encoded": None if None in encoded else int(sum(encoded)),
            "hit_ratio": [(h.get("encoder_cache") or {}).get("hit_ratio") for h in halves],
            "failed": sum(h["failed"] for h in halves), "completed": sum(h["completed"] for h in halves)}


def figures_from(runs: dict[str, list[dict[str, Any]]], setup: ReuseSetup) -> list[Figure]:
    none, reuse = _combined(runs["0%"]), _combined(runs["80%"])
    detail = {"0%": none, "80%": reuse, "setup": setup.__dict__}
    calls_ok = (reuse["encoded"] == reuse["distinct_images"] and none["encoded"] == none["distinct_images"])
    what = f"{setup.model} model, c{setup.concurrency}, {setup.halves}x{setup.requests_per_half} requests each"
    return [
        Figure("80% vs 0% image reuse: encoder calls / distinct images",
               ratio(reuse["encoded"], reuse["distinct_images"]), 1.0, "eq", detail=detail,
               note=f"80%: {reuse['encoded']} encoded of {reuse['images']} images, {reuse['distinct_images']} "
                    f"distinct; 0%: {none['encoded']} encoded of {none['distinct_images']} distinct; "
                    f"both equal: {calls_ok}"),
        Figure(f"80% vs 0% image reuse: p50 TTFT ({what})", ratio(reuse["ttft_p50_ms"], none["ttft_p50_ms"]),
               0.7, "le", detail=detail, note=f"{reuse['ttft_p50_ms']:.0f} vs {none['ttft_p50_ms']:.0f} ms"),
    ]


def run(setup: ReuseSetup, server: Server | None = None) -> list[Figure]:
    if server is not None:
        return figures_from(measure(server, setup), setup)
    from services.models.demo import demo_model_path

    with running(start_epd(str(demo_model_path(setup.model)))) as (epd,):
        return figures_from(measure(epd, setup), setup)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--epd-url", help="a running cluster (its model is used as is)")
    args = parser.parse_args(argv)
    setup = ReuseSetup.quick() if args.quick else ReuseSetup()
    print_figures(run(setup, attach_epd(args.epd_url) if args.epd_url else None), "image reuse")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
