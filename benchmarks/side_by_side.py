"""epd and a peer server on the same checkpoint, the same workload, alternating, in one run.

Shared by `vs_transformers_serve` and `vs_vllm`: the workload settings (`Workload`), the pair of
running servers (`Servers`), one `epd bench --compare` run per concurrency level with rounds
alternating A B / B A (`run_levels`), the per-side figures of a level (`side_figures`) and the
side-by-side Markdown table (`level_rows`).  A = epd, B = the peer.  Output tokens/s is completed
requests x output_len / duration on both sides, because both produce exactly `output_len`
tokens (ignore_eos or the peer's equivalent) and not every peer reports usage when streaming.
Before each side's part of a round the run waits (up to `SETTLE_S`) for the CPUs to be quiet: vLLM's
CPU engine keeps about a core busy for ~1 s after each request, which slowed epd's next request by
~180 ms at c=1 when the two sides followed each other directly (docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import ratio
from benchmarks.procs import Server

SETTLE_S = 3.0   # the longest wait for quiet CPUs before each side's part of a round (services/bench/quiet.py)


@dataclass(frozen=True)
class Workload:
    """What every level sends: `input_len` words + one image, `output_len` greedy tokens."""

    model: str = "medium"                                     # demo size
    levels: tuple[tuple[int, int], ...] = ((1, 6), (16, 32))   # (concurrency, requests per side)
    input_len: int = 64
    output_len: int = 64
    image_size: tuple[int, int] = (224, 224)
    warmup: int = 2
    threads: int | None = None                                # OMP threads per process (None: default)


@dataclass
class Servers:
    epd: Server
    peer: Server
    epd_model: str
    peer_model: str

    def stop(self) -> None:
        self.epd.stop()
        self.peer.stop()


def bench_config(servers: Servers, setup: Workload, concurrency: int, requests: int,
                 peer_extra: dict[str, Any]) -> Any:
    from services.bench import BenchConfig, Endpoint, LoadConfig, WorkloadConfig
    from services.bench.config import ImageSize

    width, height = setup.image_size
    return BenchConfig(
        endpoints=(Endpoint(servers.epd.url, model=servers.epd_model, label="A",
                            metrics_urls=tuple(servers.epd.metrics_urls()), extra_body={"temperature": 0.0}),
                   Endpoint(servers.peer.url, model=servers.peer_model, label="B", extra_body=peer_extra)),
        workload=WorkloadConfig(input_len=setup.input_len, output_len=setup.output_len,
                                image_sizes=(ImageSize(width, height),), seed=concurrency),
        load=LoadConfig(concurrency=concurrency, num_requests=requests, warmup=setup.warmup, timeout_s=1800),
        # Rounds of one concurrency's worth of requests: A B, B A, ... so the two sides alternate.
        round_size=concurrency if requests >= 2 * concurrency else requests, show_progress=False,
        settle_s=SETTLE_S)


def run_levels(servers: Servers, setup: Workload, peer_extra: dict[str, Any], plots: Path | None,
               plot_prefix: str) -> dict[str, Any]:
    """One compare run per level (latency CDFs into `plots`); returns one epd-bench/1 document."""
    from services.bench import run_bench
    from services.bench.plots import latency_cdfs
    from services.bench.report import to_json

    doc: dict[str, Any] | None = None
    for concurrency, requests in setup.levels:
        outcome = run_bench(bench_config(servers, setup, concurrency, requests, peer_extra))
        if plots is not None:
            plots.mkdir(parents=True, exist_ok=True)
            latency_cdfs(outcome.levels[0], str(plots / f"{plot_prefix}_cdf_c{concurrency}.png"))
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


def level(doc: dict[str, Any], concurrency: int) -> dict[str, Any] | None:
    """The level of `doc` run at `concurrency`, if any."""
    return next((lv for lv in doc["levels"] if lv["concurrency"] == concurrency), None)


def level_rows(doc: dict[str, Any], output_len: int) -> list[str]:
    """The side-by-side table, one row per level."""
    rows = ["| concurrency | requests/side | epd tok/s | peer tok/s | tok/s epd/peer | epd TTFT p50 (ms) | "
            "peer TTFT p50 (ms) | TTFT epd/peer | epd TPOT p50 (ms) | peer TPOT p50 (ms) | TPOT epd/peer | "
            "failed epd/peer |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for lv in doc["levels"]:
        s = side_figures(lv, output_len)
        a, b = s["A"], s["B"]
        rows.append(f"| {lv['concurrency']} | {a['completed']} | {fmt(a['output_tok_s'])} | "
                    f"{fmt(b['output_tok_s'])} | {times(ratio(a['output_tok_s'], b['output_tok_s']))} | "
                    f"{fmt(a['ttft_p50_ms'], 0)} | {fmt(b['ttft_p50_ms'], 0)} | "
                    f"{times(ratio(a['ttft_p50_ms'], b['ttft_p50_ms']))} | {fmt(a['tpot_p50_ms'], 0)} | "
                    f"{fmt(b['tpot_p50_ms'], 0)} | {times(ratio(a['tpot_p50_ms'], b['tpot_p50_ms']))} | "
                    f"{a['failed']}/{b['failed']} |")
    return rows


def fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def times(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def parse_levels(text: str | None) -> tuple[tuple[int, int], ...] | None:
    """"1:6,16:32" -> ((1, 6), (16, 32))."""
    if not text:
        return None
    return tuple((int(c), int(n)) for c, n in (part.split(":") for part in text.split(",")))
