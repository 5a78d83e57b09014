"""Results of a run as a JSON document (schema epd-bench/1) and as text tables.

JSON layout: {schema, mode, definitions, endpoints: {A: {url, model, metrics_urls}, B: ...},
config: {workload, load, slo_ms, sweep, round_size}, calibration, levels: [{concurrency,
request_rate, results: {A: summary, B: summary}, ratios (compare only), rounds (compare only)}]}.
A summary is metrics.summarize's dict plus `images`, `encoder_cache` and, with
--save-requests, `requests`. Non-finite numbers are written as null.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from . import prom
from .compare import ratios
from .metrics import image_stats, summarize
from .runner import BenchOutcome, LevelRun, SideRun
from .stream import RequestResult

SCHEMA = "epd-bench/1"
DEFINITIONS = ("vLLM benchmark definitions (vllm bench serve): TTFT from send to the first chunk with "
               "content; TPOT = (E2E - TTFT) / (output tokens - 1); ITL between content chunks; "
               "goodput = requests meeting all SLOs per second; percentiles are linear (numpy).")


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def side_summary(side: SideRun, outcome: BenchOutcome) -> dict[str, Any]:
    summary = summarize(side.results, side.duration_s, outcome.config.slo)
    summary["images"] = image_stats(side.results)
    summary["encoder_cache"] = prom.hit_ratio(side.cache_delta) if side.cache_delta else None
    if side.metrics_error:
        summary["metrics_error"] = side.metrics_error
    if outcome.config.save_requests:
        summary["requests"] = [_request_row(r) for r in side.results]
    return summary


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def _request_row(r: RequestResult) -> dict[str, Any]:
    ms = _ms
    return {"index": r.index, "ok": r.ok, "ttft_ms": ms(r.ttft_s), "tpot_ms": ms(r.tpot_s), "e2el_ms": ms(r.e2el_s),
            "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens, "status": r.status,
            "error": r.error}


def level_json(level: LevelRun, outcome: BenchOutcome) -> dict[str, Any]:
    results = {label: side_summary(side, outcome) for label, side in level.sides.items()}
    body: dict[str, Any] = {"concurrency": level.load.max_in_flight,
                            "request_rate": level.load.request_rate if level.load.is_open_loop else None,
                            "burstiness": level.load.burstiness, "results": results}
    if outcome.config.is_compare:
        body["ratios"] = ratios(results["A"], results["B"])
        body["rounds"] = len(level.rounds)
        body["settle_s"] = round(level.settle_s, 3)
    return body


def to_json(outcome: BenchOutcome) -> dict[str, Any]:
    cfg = outcome.config
    endpoints = {ep.label: {"url": ep.url, "model": outcome.models.get(ep.label),
                            "metrics_urls": list(ep.metrics_urls), "extra_body": ep.extra_body}
                 for ep in cfg.endpoints}
    config = {"workload": dataclasses.asdict(cfg.workload), "load": dataclasses.asdict(cfg.load),
              "slo_ms": cfg.slo.as_dict(), "sweep": list(cfg.sweep), "round_size": cfg.round_size,
              "settle_s": cfg.settle_s,
              "seed": cfg.workload.seed, "seed_source": "given" if cfg.seed_given else "random"}
    doc = {"schema": SCHEMA, "mode": "compare" if cfg.is_compare else "single", "definitions": DEFINITIONS,
           "endpoints": endpoints, "config": config, "calibration": outcome.calibration,
           "levels": [level_json(level, outcome) for level in outcome.levels]}
    return _clean(doc)


def write_json(doc: dict[str, Any], path: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(doc, handle, indent=2)
        handle.write("\n")
