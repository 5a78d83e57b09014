"""Decode's /metrics gauges, read from `DecodeEngine.stats()` at scrape time.

Every figure comes from the engine's own counters (one place: `EngineStats`), so an aborted
request's row and blocks show free as soon as the engine let them go.  `ENGINE_GAUGES` maps a
name to (help, read(stats)); the serving core owns them (services.observability.owned_metrics).  Names are
epd's; the vLLM-named aliases (vllm:kv_cache_usage_perc etc.) are built on the same
`engine.stats()`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import Gauge

if TYPE_CHECKING:
    from .block_pool import PoolStats
    from .runner import StepReport


@dataclass(frozen=True)
class EngineStats:
    num_slots: int
    active: int       # requests holding a batch row
    queued: int       # accepted, waiting for a row (their KV in the pool, or being copied in)
    steps: int        # forwards run
    tokens: int       # output tokens emitted (first tokens from prefill included)
    finished: int     # requests ended, any reason
    kv: PoolStats     # the block pool: blocks total/used/reserved, tokens and bytes held
    kv_bytes_copied: int = 0      # prompt KV bytes copied into the pool (one copy per request)
    attention_kernel: str = ""    # "c" | "torch" (services/decode/attention.py)
    step_mode: str = "eager"      # how the step runs: fused | eager (runner.py)
    serial_steps: int = 0         # steps of at most `serial_rows` rows, run on one thread (runner.py)
    screened_rows: int = 0        # rows whose token the LM head screen decided (services/models/head_screen.py)
    screen_full_rows: int = 0     # rows the screen sent back to the full head
    screen_candidates: int = 0    # float32 logits the screen computed for its candidates
    screen_kernel: str = ""       # the screen's kernel now: int8 | pairs | widened ("" without a screen)
    yielded_s: float = 0.0        # steps paused for prompt-side forwards on the same cores (compute_lease.py)


ENGINE_GAUGES: dict[str, tuple[str, Callable[[EngineStats], float]]] = {
    "epd_decode_slots_used": ("Batch rows (slots) in use", lambda s: s.active),
    "epd_decode_queued": ("Requests accepted, waiting for a batch row (their KV in the pool, or being copied in)",
                          lambda s: s.queued),
    "epd_decode_kv_blocks": ("KV blocks in the decode pool (all of them)", lambda s: s.kv.num_blocks),
    "epd_decode_kv_blocks_used": ("KV blocks holding tokens", lambda s: s.kv.used_blocks),
    "epd_decode_kv_blocks_reserved": ("KV blocks promised to admitted requests, not yet holding tokens",
                                      lambda s: s.kv.reserved_blocks),
    "epd_decode_kv_bytes_held": ("Bytes of the KV blocks holding tokens", lambda s: s.kv.bytes_held),
    "epd_decode_kv_tokens_held": ("Tokens whose K/V the pool holds (running and waiting requests)",
                                  lambda s: s.kv.tokens_held),
    "epd_decode_kv_held_ratio": ("KV bytes held / (tokens held x bytes per token); 1 = no waste",
                                 lambda s: s.kv.held_ratio),
    "epd_decode_kv_usage_ratio": ("Fraction of the pool's blocks used or reserved",
                                  lambda s: (s.kv.used_blocks + s.kv.reserved_blocks) / s.kv.num_blocks),
    "epd_decode_serial_steps": ("Decode steps of at most --decode-serial-rows rows, run on one thread",
                                lambda s: s.serial_steps),
    "epd_decode_lm_head_screened_rows_total": ("Rows whose token the LM head screen decided: greedy rows exactly "
                                               "(int8 or bfloat16: services/models/head_screen.py), temperature rows "
                                               "by its exact draw (int8: services/sampling/screened.py)",
                                               lambda s: s.screened_rows),
    "epd_decode_lm_head_screen_full_rows_total": ("Rows the LM head screen sent back to the full float32 head",
                                                  lambda s: s.screen_full_rows),
    "epd_decode_lm_head_screen_candidates_total": ("float32 logits the LM head screen computed for its candidates",
                                                   lambda s: s.screen_candidates),
    "epd_decode_lm_head_screen_int8": ("1 while the LM head screen runs its int8 kernel; --lm-head-screen auto moves "
                                       "to the bfloat16 pairs for good if int8 does not suit its first 64 rows",
                                       lambda s: float(s.screen_kernel == "int8")),
    "epd_decode_yield_seconds_total": ("Seconds decode steps paused, at a layer's start, while encode or prefill "
                                       "computed on the same cores (services/hostcpu/compute_lease.py)",
                                       lambda s: s.yielded_s),
    "epd_decode_kv_copied_bytes_total": ("Prompt KV bytes copied into the pool (one copy per request)",
                                   lambda s: s.kv_bytes_copied),
}
_INFO: dict[str, Gauge] = {}


def export_info(stats: EngineStats, report: StepReport) -> None:
    """`epd_decode_attention_kernel_info{kernel}` and `epd_decode_step_mode_info{mode}` (fused | eager): 1 for
    what runs."""
    for name, label, value in (("epd_decode_attention_kernel_info", "kernel", stats.attention_kernel),
                               ("epd_decode_step_mode_info", "mode", report.mode)):
        info = _gauge(name, f"Decode {label} in use (1)", [label])
        info.labels(value).set(1)


def _gauge(name: str, help: str, labels: list[str]) -> Gauge:
    gauge = _INFO.get(name) or _INFO.setdefault(name, Gauge(name, help, labels))
    gauge.clear()
    return gauge
