"""The capacity model of docs/capacity.md: how many encode, prefill and decode instances a workload needs.

Inputs are per-stage costs (`StageCosts`, measured by benchmarks/stage_costs.py, or any other
source such as published GPU figures) and a `Workload`.  Per second of traffic:

- render:  λ·k·R(s)               instance-seconds (image processing, CPU)
- encode:  λ·k·(1-h)·E(s)         (h = encoder-cache hit ratio, i.e. image reuse)
- prefill: λ·P(T + k·n(s))        (P fitted as a + b·L + c·L² over the measured prompt lengths)
- decode:  a request holds a slot for O steps; at batch B a step takes D(B) = d0 + d1·B, so an
  instance makes B/D(B) tokens/s.  The rows in flight are λ·O·D(B) (Little's law); they are
  split over N_D instances, B = λ·O·D(B)/N_D, which must stay within the slots and D(B) within
  the TPOT objective.

Instances = ceil(load / ρ) with ρ the target utilisation (0.7 by default: queues stay short).
Bytes per second through the connectors: λ·k·(1-h)·n(s)·embedding bytes per token (EC) and
λ·(T + k·n(s))·KV bytes per token (KV).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from benchmarks.stage_costs import StageCosts


@dataclass(frozen=True)
class Workload:
    request_rate: float              # λ, requests/s
    images_per_request: int = 1      # k
    image_size: str = "224x224"      # s, a key of the costs tables
    text_tokens: int = 64            # T
    output_tokens: int = 64          # O
    reuse: float = 0.0               # h, fraction of images already encoded


@dataclass(frozen=True)
class Objectives:
    utilisation: float = 0.7         # ρ
    tpot_s: float | None = None      # decode step must stay under this
    decode_slots: int = 16           # rows one decode instance batches


def _fit_line(points: dict[int, float]) -> tuple[float, float]:
    """Least-squares a + b·x."""
    xs, ys = list(points), list(points.values())
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    return my - slope * mx, slope if n > 1 else 0.0


@dataclass
class CostModel:
    """Cost functions fitted to measured (or quoted) per-stage costs."""

    costs: StageCosts
    prefill_fit: tuple[float, float] = (0.0, 0.0)     # a, b: P(L) = a + b·L
    decode_fit: tuple[float, float] = (0.0, 0.0)      # d0, d1: D(B) = d0 + d1·B

    @classmethod
    def from_costs(cls, costs: StageCosts) -> CostModel:
        return cls(costs, _fit_line(costs.prefill_s), _fit_line(costs.decode_step_s))

    def prefill_s(self, tokens: float) -> float:
        a, b = self.prefill_fit
        return max(a + b * tokens, 0.0)

    def decode_step_s(self, batch: float) -> float:
        d0, d1 = self.decode_fit
        return d0 + d1 * batch

    def image_tokens(self, size: str) -> int:
        return self.costs.image_tokens[size]


@dataclass
class Plan:
    workload: Workload
    instances: dict[str, int]
    load: dict[str, float]                    # instance-seconds per second, per role
    decode_batch: float                       # rows per decode instance
    decode_step_s: float                      # = TPOT at that batch
    ttft_floor_s: float                       # render + encode + prefill of one request, no queueing
    ec_bytes_per_s: float
    kv_bytes_per_s: float
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "workload": self.workload.__dict__}


def plan(model: CostModel, w: Workload, goal: Objectives = Objectives()) -> Plan:
    prompt = w.text_tokens + w.images_per_request * model.image_tokens(w.image_size)
    images_per_s = w.request_rate * w.images_per_request
    load = {"render": images_per_s * model.costs.render_s[w.image_size],
            "encode": images_per_s * (1 - w.reuse) * model.costs.encode_s[w.image_size],
            "prefill": w.request_rate * model.prefill_s(prompt)}
    instances = {role: max(1, math.ceil(value / goal.utilisation)) for role, value in load.items()}
    decode_n, batch, step, notes = _decode_instances(model, w, goal)
    instances["decode"] = decode_n
    load["decode"] = batch * decode_n / goal.decode_slots   # slot-instances in use
    ttft = (w.images_per_request * (model.costs.render_s[w.image_size] + (1 - w.reuse)
                                    * model.costs.encode_s[w.image_size]) + model.prefill_s(prompt))
    return Plan(w, instances, load, batch, step, ttft,
                ec_bytes_per_s=images_per_s * (1 - w.reuse) * model.image_tokens(w.image_size)
                * model.costs.embedding_bytes_per_token,
                kv_bytes_per_s=w.request_rate * prompt * model.costs.kv_bytes_per_token, notes=notes)


def _decode_instances(model: CostModel, w: Workload, goal: Objectives) -> tuple[int, float, float, list[str]]:
    """Fewest instances whose batch fits the slots, the TPOT objective and the utilisation."""
    for n in range(1, 10_000):
        batch = _batch(model, w.request_rate * w.output_tokens, n)
        if batch is None:
            continue
        step = model.decode_step_s(batch)
        # A continuous-batching instance steps whenever a row is in flight: its load is its batch, so
        # the utilisation target applies to the slots.
        fits = batch <= goal.decode_slots * goal.utilisation
        if fits and (goal.tpot_s is None or step <= goal.tpot_s):
            return n, batch, step, []
    return 10_000, math.inf, math.inf, ["no decode configuration meets the objectives"]


def _batch(model: CostModel, tokens_per_s: float, instances: int) -> float | None:
    """Rows per instance B solving B = (tokens/s / N)·D(B), i.e. B = r·d0 / (1 - r·d1); None if unstable."""
    d0, d1 = model.decode_fit
    rate = tokens_per_s / instances
    if rate * d1 >= 1.0:
        return None
    return max(rate * d0 / (1.0 - rate * d1), 0.0)


def shared_machine_rate(model: CostModel, w: Workload, batch: float) -> float:
    """Requests/s when every stage shares the same cores (epd serve on one box): 1 / Σ stage time."""
    prompt = w.text_tokens + w.images_per_request * model.image_tokens(w.image_size)
    per_request = (w.images_per_request * (model.costs.render_s[w.image_size]
                                           + (1 - w.reuse) * model.costs.encode_s[w.image_size])
                   + model.prefill_s(prompt) + w.output_tokens * model.decode_step_s(batch) / batch)
    return 1.0 / per_request
