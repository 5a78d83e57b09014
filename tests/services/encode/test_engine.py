"""EncodeEngine: concurrent callers share vision-tower forwards; results equal encoding alone."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from services.encode.engine import EncodeEngine
from services.models.base import VisionModel
from services.protocol.errors import DeadlineExceeded, Unavailable
from tests.services.models.helpers import picture

SIZES = [(448, 448), (224, 336), (448, 280), (224, 224), (280, 224)]


class GatedVision(VisionModel):
    """The real tower, whose first forward waits for `release` so that later items pile up meanwhile."""

    def __init__(self, inner: VisionModel, costed: bool = False) -> None:
        self.inner, self.hidden_size, self.dtype = inner, inner.hidden_size, inner.dtype
        if costed:   # the FLOP estimate can read the tower: small forwards may run inline (else never)
            self.tower, self.patches_per_token = inner.tower, inner.patches_per_token
        self.started, self.release = threading.Event(), threading.Event()
        self.batch_sizes: list[int] = []

    def num_tokens(self, metadata):
        return self.inner.num_tokens(metadata)

    def encode(self, items):
        self.batch_sizes.append(len(items))
        self.started.set()
        assert self.release.wait(30)
        return self.inner.encode(items)


@pytest.fixture(scope="module")
def vision(demo_model_path):
    from services.models.registry import adapter_for

    return adapter_for(demo_model_path).load_vision(demo_model_path, "cpu", "float32")


@pytest.fixture(scope="module")
def items(demo_model_path):
    from services.models.processing import load_image_processor

    image_processor = load_image_processor(demo_model_path)
    out = []
    for seed, (width, height) in enumerate(SIZES):
        features = image_processor(images=[picture(width, height, seed)], return_tensors="pt")
        grid = features["image_grid_thw"][0]
        out.append({"pixel_values": features["pixel_values"], "image_grid_thw": grid})
    return out


def submit_all(engine: EncodeEngine, gated: GatedVision, items: list[dict]) -> list:
    """Item 0 starts a forward alone; the rest arrive from other threads while it is held."""
    results: list = [None] * len(items)

    def call(index: int) -> None:
        try:
            results[index] = engine.encode([items[index]], timeout=30)[0]["embedding"]
        except Exception as exc:
            results[index] = exc

    threads = [threading.Thread(target=call, args=(0,))]
    threads[0].start()
    assert gated.started.wait(30)
    threads += [threading.Thread(target=call, args=(i,)) for i in range(1, len(items))]
    for thread in threads[1:]:
        thread.start()
    wait_until(lambda: engine.num_pending == len(items) - 1)
    gated.release.set()
    for thread in threads:
        thread.join(30)
    return results


def wait_until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def test_concurrent_items_share_forwards(vision, items):
    alone = [vision.encode([item])[0] for item in items]
    gated = GatedVision(vision)
    with EncodeEngine(gated, max_batch_tokens=100_000) as engine:
        results = submit_all(engine, gated, items)
    assert gated.batch_sizes == [1, len(items) - 1]
    assert engine.num_forwards == 2 < len(items) == engine.num_items
    assert engine.num_tokens == sum(vision.num_tokens(item) for item in items)
    for got, want in zip(results, alone, strict=True):
        assert got.shape == want.shape and got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_token_budget_bounds_each_forward(vision, items):
    same = [items[3]] * 5  # 224x224: 64 tokens each
    gated = GatedVision(vision)
    with EncodeEngine(gated, max_batch_tokens=128) as engine:
        results = submit_all(engine, gated, same)
    assert gated.batch_sizes == [1, 2, 2]
    assert all(torch.equal(result, results[0]) for result in results)


def test_one_caller_many_items_keeps_order(vision, items):
    with EncodeEngine(vision, max_batch_tokens=100_000) as engine:
        results = [entry["embedding"] for entry in engine.encode(items, timeout=30)]
    assert [r.shape[0] for r in results] == [vision.num_tokens(item) for item in items]
    assert engine.num_forwards == 1


def test_bad_item_fails_only_its_caller(vision, items):
    bad = {"pixel_values": items[0]["pixel_values"][:-4], "image_grid_thw": items[0]["image_grid_thw"]}
    batch = [items[3], items[1], bad, items[2]]
    gated = GatedVision(vision)
    with EncodeEngine(gated, max_batch_tokens=100_000) as engine:
        results = submit_all(engine, gated, batch)
    assert isinstance(results[2], ValueError) and "pixel_values" in str(results[2])
    for index in (0, 1, 3):
        torch.testing.assert_close(results[index], vision.encode([batch[index]])[0], rtol=0, atol=1e-6)


def test_timeout_and_close(vision, items):
    gated = GatedVision(vision)
    engine = EncodeEngine(gated, max_batch_tokens=100_000)
    with pytest.raises(DeadlineExceeded):
        engine.encode([items[3]], timeout=0.2)  # held in the gated forward
    gated.release.set()
    engine.close()
    with pytest.raises(Unavailable):
        engine.encode([items[3]], timeout=5)


class ThreadNoting(VisionModel):
    """The real tower, noting which thread ran each forward."""

    def __init__(self, inner: VisionModel) -> None:
        self.inner, self.hidden_size, self.dtype = inner, inner.hidden_size, inner.dtype
        self.tower, self.patches_per_token = inner.tower, inner.patches_per_token   # what the FLOP estimate reads
        self.threads: list[str] = []

    def num_tokens(self, metadata):
        return self.inner.num_tokens(metadata)

    def encode(self, items):
        self.threads.append(threading.current_thread().name)
        return self.inner.encode(items)


def test_an_idle_engine_runs_a_small_forward_on_the_callers_thread(vision, items):
    noting = ThreadNoting(vision)
    with EncodeEngine(noting, max_batch_tokens=100_000) as engine:
        inline = engine.run_inline([items[3]])
        queued = engine.encode([items[3]], timeout=30)
    assert inline is not None and noting.threads == [threading.current_thread().name, "encode-engine"]
    torch.testing.assert_close(inline[0]["embedding"], queued[0]["embedding"], rtol=0, atol=0)
    assert engine.num_forwards == 2 and engine.num_items == 2
    assert engine.num_tokens == 2 * vision.num_tokens(items[3])


def test_a_busy_engine_or_a_large_forward_is_not_run_inline(vision, items, monkeypatch):
    from services.hostcpu import compute_threads

    gated = GatedVision(vision, costed=True)
    with EncodeEngine(gated, max_batch_tokens=100_000) as engine:
        [running] = engine.submit([items[3]])
        assert gated.started.wait(30)
        assert engine.run_inline([items[3]]) is None   # a forward runs
        gated.release.set()
        running.result(30)
        wait_until(lambda: not engine._busy)
        assert engine.run_inline([items[3]]) is not None
        monkeypatch.setattr(compute_threads, "INLINE_FORWARD_FLOPS", 0.0)
        assert engine.run_inline([items[3]]) is None   # too large to stall the caller's loop
    assert gated.batch_sizes == [1, 1]


def test_inline_never_waits_for_the_compute_lease(vision, items, tmp_path, monkeypatch):
    import fcntl
    import os

    from services.hostcpu import compute_lease

    path = compute_lease.create(str(tmp_path / "lease"))
    monkeypatch.setattr(compute_lease, "_LEASE", [compute_lease.ComputeLease(path, 0)])
    other = os.open(path, os.O_RDWR)   # another open file: as another process's holder
    fcntl.flock(other, fcntl.LOCK_EX)
    try:
        with EncodeEngine(vision, max_batch_tokens=100_000) as engine:
            began = time.monotonic()
            assert engine.run_inline([items[3]]) is None
            assert time.monotonic() - began < 0.5 and engine.num_forwards == 0
            fcntl.flock(other, fcntl.LOCK_UN)
            assert engine.run_inline([items[3]]) is not None and engine.num_forwards == 1
            assert engine.encode([items[3]], timeout=30)   # the worker takes it afterwards as before
    finally:
        os.close(other)
        compute_lease._LEASE[0].close()
