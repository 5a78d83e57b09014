"""Text rendering of an epd-bench/1 document: per-run blocks, compare and sweep tables."""

from __future__ import annotations

from typing import Any

_WIDTH = 64
_LATENCIES = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2el_ms"))


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _line(label: str, value: str) -> str:
    return f"{label:<40}{value:>24}"


def summary_block(title: str, s: dict[str, Any]) -> list[str]:
    lines = [f" {title} ".center(_WIDTH, "="),
             _line("Completed / failed requests:", f"{s['completed']} / {s['failed']}"),
             _line("Duration (s):", _num(s["duration_s"])),
             _line("Request throughput (req/s):", _num(s["request_throughput"])),
             _line("Output token throughput (tok/s):", _num(s["output_throughput"])),
             _line("Total token throughput (tok/s):", _num(s["total_token_throughput"])),
             _line("Prompt / output tokens:", f"{s['prompt_tokens']} / {s['output_tokens']}")]
    if "goodput" in s:
        slo = " ".join(f"{k}<={v:g}ms" for k, v in s["goodput"]["slo_ms"].items())
        lines.append(_line(f"Goodput (req/s) [{slo}]:", _num(s["goodput"]["request_goodput"])))
    lines += _cache_lines(s)
    lines.append(" latency (ms) ".center(_WIDTH, "-"))
    lines.append(f"{'':<8}" + "".join(f"{h:>14}" for h in ("mean", "p50", "p90", "p99")))
    for name, key in _LATENCIES:
        lines.append(f"{name:<8}" + "".join(f"{_num(s[key][p]):>14}" for p in ("mean", "p50", "p90", "p99")))
    client = s["client"]
    lines.append(_line("Client parse overhead (us/req, us/chunk):",
                       f"{_num(client['parse_us_per_request'], 1)}, {_num(client['parse_us_per_chunk'], 1)}"))
    lines += [f"  error x{e['count']}: {e['error'][:100]}" for e in s["errors"]]
    return lines


def _cache_lines(s: dict[str, Any]) -> list[str]:
    lines = []
    images = s.get("images") or {}
    if images.get("images"):
        lines.append(_line("Images sent / distinct:", f"{images['images']} / {images['distinct_images']}"))
    ideal = images.get("ideal_hit_ratio")
    cache = s.get("encoder_cache")
    if cache:
        lines.append(_line("Encoder-cache hits, measured / ideal:",
                           f"{_num(cache['hit_ratio'], 3)} / {_num(ideal, 3)} of {cache['items']:g} items"))
        if cache.get("encoded") is not None:
            lines.append(_line("Items encoded (ran the vision tower):", f"{cache['encoded']:g}"))
        groups = cache.get("frame_groups")
        if groups and groups["groups"]:
            lines.append(_line("Video frame-group hits:", f"{_num(groups['hit_ratio'], 3)} of {groups['groups']:g} "
                               "groups"))
    elif ideal:  # images reused, no --metrics-url to measure the cache with
        lines.append(_line("Encoder-cache hits, ideal:", _num(ideal, 3)))
    if s.get("metrics_error"):
        lines.append("  " + s["metrics_error"][:120])
    return lines


def ratio_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [f"{'figure':<26}{'A':>12}{'B':>12}{'B/A':>8}{'A/B':>8}"]
    for row in rows:
        lines.append(f"{row['figure']:<26}{_num(row['a']):>12}{_num(row['b']):>12}"
                     f"{_num(row['b_over_a']):>8}{_num(row['a_over_b']):>8}")
    return lines


def sweep_table(doc: dict[str, Any]) -> list[str]:
    lines = [" sweep ".center(_WIDTH, "="),
             f"{'side':<6}{'conc':>6}{'req/s':>10}{'out tok/s':>12}{'p50 TTFT':>12}{'p99 TTFT':>12}"]
    for level in doc["levels"]:
        for label, s in level["results"].items():
            lines.append(f"{label:<6}{level['concurrency'] or '-':>6}{_num(s['request_throughput']):>10}"
                         f"{_num(s['output_throughput']):>12}{_num(s['ttft_ms']['p50']):>12}"
                         f"{_num(s['ttft_ms']['p99']):>12}")
    return lines


def calibration_lines(cal: dict[str, Any]) -> list[str]:
    return [" client calibration (null server) ".center(_WIDTH, "="),
            _line("Requests / concurrency:", f"{cal['requests']} / {cal['concurrency']}"),
            _line("Max request throughput (req/s):", _num(cal["request_throughput"])),
            _line("TTFT p50 / p99 (ms):", f"{_num(cal['ttft_ms']['p50'])} / {_num(cal['ttft_ms']['p99'])}"),
            _line("E2E p50 / p99 (ms):", f"{_num(cal['e2el_ms']['p50'])} / {_num(cal['e2el_ms']['p99'])}")]


def render(doc: dict[str, Any]) -> str:
    config = doc.get("config") or {}
    lines: list[str] = []
    if "seed" in config:
        how = "given" if config.get("seed_source") == "given" else "random: --seed " + str(config["seed"]) + \
            " sends the same requests again"
        lines.append(f"seed {config['seed']} ({how})")
    if doc.get("calibration"):
        lines += calibration_lines(doc["calibration"])
    for level in doc["levels"]:
        how = f"rate {level['request_rate']:g}/s" if level["request_rate"] else f"concurrency {level['concurrency']}"
        for label, s in level["results"].items():
            ep = doc["endpoints"][label]
            lines += summary_block(f"{label}: {ep['url']} ({how})", s)
        if "ratios" in level:
            lines += [f" B/A ({how}) ".center(_WIDTH, "=")] + ratio_table(level["ratios"])
    if len(doc["levels"]) > 1:
        lines += sweep_table(doc)
    return "\n".join(lines + ["=" * _WIDTH])
