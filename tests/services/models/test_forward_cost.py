"""A forward's FLOP estimate (services/models/forward_cost.py) and the threads it gets (compute_threads.use_for)."""

from __future__ import annotations

import threading

import pytest

from services.hostcpu import compute_threads
from services.models.forward_cost import PrefillCost, VisionCost


@pytest.fixture(scope="module")
def tiny(demo_model_path):
    from services.models.registry import adapter_for

    adapter = adapter_for(demo_model_path)
    return adapter.load_vision(demo_model_path), adapter.load_language(demo_model_path)


def test_the_estimate_counts_weights_and_attention(tiny):
    vision, lm = tiny
    cost = VisionCost(vision)
    tower = sum(p.numel() for p in vision.tower.parameters()) + sum(b.numel() for b in vision.tower.buffers())
    assert cost.params == tower and cost.patches_per_token == 4  # Qwen2-VL merges 2x2 patches per token
    patches = 64 * 4
    assert cost.flops([64]) == pytest.approx(2 * tower * patches + 4 * patches**2 * cost.width * cost.depth)
    assert cost.flops([64, 64]) == pytest.approx(2 * cost.flops([64]))
    prefill = PrefillCost(lm)
    layers = sum(p.numel() for name, p in [*lm.model.named_parameters(), *lm.model.named_buffers()]
                 if "embed_tokens" not in name)
    assert prefill.params == layers
    expected = 2 * prefill.head + 2 * layers * 100 + 4 * 100 * 100 * prefill.width * prefill.depth
    assert prefill.flops([(0, 100)], finishing=1) == pytest.approx(expected)


def test_prepacked_linears_still_count(demo_model_path):
    """The prepacked kernels keep their panels as plain attributes: the count must not drop to the norms."""
    from services.models.prepack import prepack_language
    from services.models.registry import adapter_for

    lm = adapter_for(demo_model_path).load_language(demo_model_path)
    before = PrefillCost(lm).params
    prepack_language(lm, "panel")
    assert PrefillCost(lm).params >= before


def test_a_small_forward_runs_on_one_thread_in_a_role_process(monkeypatch):
    import torch

    monkeypatch.setenv(compute_threads.ENV, "2")
    seen = {}

    def engine_thread() -> None:
        compute_threads.enter()
        compute_threads.use_for(compute_threads.SMALL_FORWARD_FLOPS / 2)
        seen["small"] = torch.get_num_threads()
        compute_threads.use_for(compute_threads.SMALL_FORWARD_FLOPS * 2)
        seen["big"] = torch.get_num_threads()
        compute_threads.use_for(float("inf"))
        seen["unknown"] = torch.get_num_threads()

    threads = torch.get_num_threads()
    try:
        worker = threading.Thread(target=engine_thread)
        worker.start()
        worker.join(30)
    finally:
        torch.set_num_threads(threads)
    assert seen == {"small": 1, "big": 2, "unknown": 2}


def test_outside_a_role_process_the_count_is_left_alone(monkeypatch):
    import torch

    monkeypatch.delenv(compute_threads.ENV, raising=False)
    before = torch.get_num_threads()
    compute_threads.use_for(1.0)
    assert torch.get_num_threads() == before
