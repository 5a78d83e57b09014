"""Figures of one run, with vLLM's benchmark definitions (vllm bench serve).

- request throughput = completed requests / run duration; output throughput =
  output tokens / duration; total token throughput = (prompt + output) / duration.
- TTFT, TPOT = (E2E - TTFT) / (output tokens - 1) per request with more than one
  output token, ITL = every gap between content chunks of every request, E2E
  latency: mean, std, p50, p90, p99 over completed requests, in milliseconds.
- goodput = requests meeting every given SLO (TTFT, TPOT, E2E; a one-token
  answer's TPOT counts as 0) / duration.
Failed requests count only in `failed` and the error samples.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from .config import Slo
from .stream import RequestResult

PERCENTILES = (50, 90, 99)
MAX_ERROR_SAMPLES = 5


def stats_ms(values_s: Sequence[float]) -> dict[str, float | int | None]:
    """mean/std/min/p50/p90/p99/max in milliseconds (None when there are no values)."""
    if not values_s:
        return {"n": 0, "mean": None, "std": None, "min": None, **{f"p{p}": None for p in PERCENTILES},
                "max": None}
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    pcts = np.percentile(ms, PERCENTILES)
    return {"n": int(ms.size), "mean": float(ms.mean()), "std": float(ms.std()), "min": float(ms.min()),
            **{f"p{p}": float(v) for p, v in zip(PERCENTILES, pcts, strict=True)}, "max": float(ms.max())}


def is_good(result: RequestResult, slo: Slo) -> bool:
    checks = ((slo.ttft_ms, result.ttft_s), (slo.tpot_ms, result.tpot_s or 0.0), (slo.e2el_ms, result.e2el_s))
    return all(limit is None or (value is not None and value * 1000.0 <= limit) for limit, value in checks)


def error_samples(failed: Sequence[RequestResult]) -> list[dict[str, Any]]:
    counts = Counter(r.error or "unknown" for r in failed)
    return [{"error": error, "count": n} for error, n in counts.most_common(MAX_ERROR_SAMPLES)]


def summarize(results: Sequence[RequestResult], duration_s: float, slo: Slo) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    prompt = sum(r.prompt_tokens for r in done)
    output = sum(r.output_tokens for r in done)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    summary: dict[str, Any] = {
        "completed": len(done), "failed": len(failed), "errors": error_samples(failed),
        "duration_s": duration_s, "request_throughput": len(done) * per_s,
        "output_throughput": output * per_s, "total_token_throughput": (prompt + output) * per_s,
        "prompt_tokens": prompt, "output_tokens": output,
        "usage_reported": sum(r.has_usage for r in done),
        "ttft_ms": stats_ms([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot_ms": stats_ms([r.tpot_s for r in done if r.tpot_s is not None]),
        "itl_ms": stats_ms([gap for r in done for gap in r.itl_s]),
        "e2el_ms": stats_ms([r.e2el_s for r in done if r.e2el_s is not None]),
        "client": client_overhead(done),
    }
    if slo.is_set:
        good = sum(is_good(r, slo) for r in done)
        summary["goodput"] = {"slo_ms": slo.as_dict(), "good": good, "request_goodput": good * per_s,
                              "good_fraction": good / len(results) if results else 0.0}
    return summary


def client_overhead(done: Sequence[RequestResult]) -> dict[str, float | None]:
    """Time the client spent decoding and timing streams, per request and per content chunk."""
    chunks = sum(r.num_chunks for r in done)
    spent = sum(r.client_s for r in done)
    return {"parse_us_per_request": spent / len(done) * 1e6 if done else None,
            "parse_us_per_chunk": spent / chunks * 1e6 if chunks else None}


def image_stats(results: Sequence[RequestResult]) -> dict[str, Any]:
    """Images sent, distinct ones, and the hit ratio a perfect per-item cache would reach."""
    ids = [i for r in results for i in r.image_ids]
    distinct = len(set(ids))
    return {"images": len(ids), "distinct_images": distinct,
            "ideal_hit_ratio": 1.0 - distinct / len(ids) if ids else None}
