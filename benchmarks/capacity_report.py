"""Text and Markdown for benchmarks/capacity.py's results (measured costs, plans, check, GPU example)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.common import replace_block


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:,.1f}"


def costs_table(costs: dict[str, Any]) -> str:
    rows = ["| stage | input | seconds per unit (ms) |", "|---|---|---|"]
    for size, s in costs["render_s"].items():
        rows.append(f"| render (whole request) | 64 words + one {size} image | {_ms(s)} |")
    for size, s in costs["encode_s"].items():
        rows.append(f"| encode (vision forward) | one {size} image = {costs['image_tokens'][size]} tokens | {_ms(s)} |")
    for tokens, s in costs["prefill_s"].items():
        rows.append(f"| prefill | {tokens}-token prompt | {_ms(s)} |")
    for batch, s in costs["decode_step_s"].items():
        rows.append(f"| decode step | {batch} rows at context {costs['decode_context']} | {_ms(s)} |")
    rows.append(f"| bytes | per image token (embedding) / per prompt token (KV) | "
                f"{costs['embedding_bytes_per_token']:,} B / {costs['kv_bytes_per_token']:,} B |")
    return "\n".join(rows)


def plans_table(plans: list[dict[str, Any]]) -> str:
    rows = ["| λ (req/s) | images/req | size | text/out tokens | render | encode | prefill | decode | "
            "decode rows/instance | TPOT (ms) | TTFT floor (ms) | EC MB/s | KV MB/s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in plans:
        w, n = p["workload"], p["instances"]
        rows.append(f"| {w['request_rate']:g} | {w['images_per_request']} | {w['image_size']} | "
                    f"{w['text_tokens']}/{w['output_tokens']} | {n['render']} | {n['encode']} | {n['prefill']} | "
                    f"{n['decode']} | {p['decode_batch']:.1f} | {_ms(p['decode_step_s'])} | {_ms(p['ttft_floor_s'])} | "
                    f"{p['ec_bytes_per_s'] / 1e6:,.1f} | {p['kv_bytes_per_s'] / 1e6:,.1f} |")
    return "\n".join(rows)


def check_table(check: dict[str, Any]) -> str:
    m, p, r = check["measured"], check["predicted"], check["measured_over_predicted"]
    rows = ["| figure | measured in the cluster | model | measured / model |", "|---|---|---|---|"]
    for key, label in (("render_s", "render per request (ms)"), ("encode_s", "encode per image (ms)"),
                       ("prefill_s", f"prefill per request ({m['prompt_tokens']:.0f} tokens, ms)"),
                       ("decode_step_s", f"decode step at batch {m['decode_batch']:.1f} (ms)")):
        rows.append(f"| {label} | {_ms(m[key])} | {_ms(p[key])} | {_ratio(r[key])} |")
    rows.append(f"| request throughput (req/s) | {m['request_rate']:.3f} | {p['request_rate']:.3f} | "
                f"{_ratio(r['request_rate'])} |")
    return "\n".join(rows)


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def print_report(result: dict[str, Any]) -> None:
    print("\n== per-stage costs ==\n" + costs_table(result["costs"]))
    print("\n== plans ==\n" + plans_table(result["plans"]))
    if "check" in result:
        print("\n== check against a measured run ==\n" + check_table(result["check"]))
    gpu = result["gpu_example"]
    print("\n== GPU example (estimated per-stage costs) ==\n" + costs_table(gpu["costs"]) + "\n\n"
          + plans_table(gpu["plans"]))


def write_blocks(result: dict[str, Any], doc: Path, command: str) -> None:
    where = result["machine"]
    head = (f"Command: `{command.strip()}` ({where['time']}, {where['cpus']} CPUs shared with other jobs, load "
            f"average at start {where['loadavg_at_start']}, torch threads {result['costs']['threads']}).\n\n")
    a, b = result["prefill_fit"]
    d0, d1 = result["decode_fit"]
    fits = (f"\n\nFits: P(L) = {a * 1e3:.1f} ms + {b * 1e3:.3f} ms·L; D(B) = {d0 * 1e3:.1f} ms + {d1 * 1e3:.2f} ms·B.")
    replace_block(doc, "capacity-costs", head + costs_table(result["costs"]) + fits)
    replace_block(doc, "capacity-plans", plans_table(result["plans"]))
    if "check" in result:
        c = result["check"]
        replace_block(doc, "capacity-check", f"Closed loop, concurrency {c['concurrency']}, {c['requests']} "
                      f"one-image requests.\n\n" + check_table(c))
    gpu = result["gpu_example"]
    replace_block(doc, "capacity-gpu", costs_table(gpu["costs"]) + "\n\n" + plans_table(gpu["plans"]))
