"""A forward's rough FLOP count, from the weights it runs through and the tokens it runs on.

Used to pick a forward's thread count (services.hostcpu.compute_threads.use_for): a small forward runs on one
thread.  Why (measured, docs/benchmarks.md "Small forwards on one thread"): on this VM a forward on two
OpenMP threads whose cores idled a few tens of milliseconds pays a sleeping worker's wake-up at each of its
hundreds of parallel regions; the tiny model's vision forward took 11.8 ms instead of 1.6 after a 0.1 s
pause, and one thread avoids it.  Big forwards (the medium model's) gain more from the second core than
they lose to wake-ups, so they keep every thread.

The counts are estimates (2 FLOPs per weight per token, plus the attention scores and values, plus the LM
head for each prompt that finishes); overestimating only keeps a forward on all its threads.
"""

from __future__ import annotations

from typing import Any


def _params(module: Any, skip: tuple[str, ...] = ()) -> int:
    """Weights the module holds: its parameters and buffers, and the tensors its submodules keep as plain
    attributes (the prepacked linears of services/models/prepack.py hold their panels that way)."""
    if module is None or not hasattr(module, "named_modules"):
        return 0
    import torch

    seen, total = set(), 0
    for name, sub in module.named_modules():
        if any(s in name for s in skip):
            continue
        values = [*sub._parameters.values(), *sub._buffers.values(), *vars(sub).values()]
        for value in values:
            if isinstance(value, torch.Tensor) and id(value) not in seen:  # oneDNN's opaque tensors have no data_ptr
                seen.add(id(value))
                total += value.numel()
    return total


def _first(config: Any, *names: str, default: int = 0) -> int:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return default


class VisionCost:
    """FLOPs of one vision-tower forward over items of known embedding-token counts."""

    def __init__(self, vision: Any) -> None:
        tower = getattr(vision, "tower", None)
        config = getattr(tower, "config", None)
        config = getattr(config, "vision_config", config)
        self.params = _params(tower)
        self.width = _first(config, "embed_dim", "hidden_size")
        self.depth = _first(config, "depth", "num_hidden_layers")
        self.patches_per_token = int(getattr(vision, "patches_per_token", 1) or 1)

    def flops(self, tokens: list[int]) -> float:
        """`tokens`: each item's embedding tokens (VisionModel.num_tokens); inf when the tower is unknown."""
        if not self.params:
            return float("inf")
        total = 0.0
        for count in tokens:
            patches = count * self.patches_per_token
            total += 2.0 * self.params * patches + 4.0 * patches * patches * self.width * self.depth
        return total


class PrefillCost:
    """FLOPs of one prefill forward over chunks of prompts (rows [start, end) of each)."""

    def __init__(self, lm: Any) -> None:
        model = getattr(lm, "model", None)
        config = getattr(model, "config", None)
        self.params = _params(model, skip=("embed_tokens",))
        self.head = _params(getattr(lm, "lm_head", None))
        self.width = _first(config, "hidden_size")
        self.depth = _first(config, "num_hidden_layers")

    def flops(self, spans: list[tuple[int, int]], finishing: int) -> float:
        """`spans`: each chunk's (start, end) rows; `finishing`: how many prompts end in this forward."""
        if not self.params:
            return float("inf")
        total = 2.0 * self.head * finishing
        for start, end in spans:
            rows = end - start
            total += 2.0 * self.params * rows + 4.0 * rows * end * self.width * self.depth
        return total
