"""Side-by-side figures of two endpoints as ratios.

Every figure is given as B/A; for lower-is-better figures (latencies) A/B is
given too, since "B is 1.8x faster" reads better as A/B = 1.8 than B/A = 0.56.
A ratio is None when either side has no value or the denominator is 0.
"""

from __future__ import annotations

from typing import Any

# (figure key path in a summary, lower is better)
FIGURES: tuple[tuple[str, bool], ...] = (
    ("request_throughput", False),
    ("output_throughput", False),
    ("total_token_throughput", False),
    ("goodput.request_goodput", False),
    ("ttft_ms.mean", True), ("ttft_ms.p50", True), ("ttft_ms.p90", True), ("ttft_ms.p99", True),
    ("tpot_ms.mean", True), ("tpot_ms.p50", True), ("tpot_ms.p99", True),
    ("itl_ms.p50", True), ("itl_ms.p99", True),
    ("e2el_ms.mean", True), ("e2el_ms.p50", True), ("e2el_ms.p99", True),
    ("encoder_cache.hit_ratio", False),
    ("failed", True),
)


def lookup(summary: dict[str, Any], path: str) -> float | None:
    node: Any = summary
    for key in path.split("."):
        if not isinstance(node, dict) or node.get(key) is None:
            return None
        node = node[key]
    return float(node) if isinstance(node, int | float) else None


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or den is None or den == 0 else num / den


def ratios(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for path, lower_is_better in FIGURES:
        va, vb = lookup(a, path), lookup(b, path)
        if va is None and vb is None:
            continue
        rows.append({"figure": path, "a": va, "b": vb, "b_over_a": _ratio(vb, va),
                     "a_over_b": _ratio(va, vb) if lower_is_better else None, "lower_is_better": lower_is_better})
    return rows
