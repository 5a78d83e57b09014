"""Kernel choices kept between starts (services/models/kernel_choices.py): `--linear-kernel auto` times a shape
once per machine and code; a restart or a second process swaps to the same kernels without timing, and whatever
the timing depended on changing, or a kept file that is not to be trusted, times again."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from services.models import fused_mlp, kernel_choices, packed_linear, prepack
from services.models.panel_linear import PanelLinear
from services.models.prepack import PackedLinear, prepack_language
from tests.services.models.test_prepack import _load


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EPD_CACHE_DIR", str(tmp_path))
    return tmp_path / kernel_choices.FOLDER


@pytest.fixture
def timings(monkeypatch):
    """How many timings ran (each call of the real timing, counted and passed through)."""
    counted = {"linear": 0, "fused_mlp": 0}
    measure, compare = prepack._measure_alone, packed_linear._compare

    def counted_measure(*args, **kwargs):
        counted["linear"] += 1
        return measure(*args, **kwargs)

    def counted_compare(candidates, x):
        if "fused" in candidates:
            counted["fused_mlp"] += 1
        return compare(candidates, x)

    monkeypatch.setattr(prepack, "_measure_alone", counted_measure)
    monkeypatch.setattr(packed_linear, "_compare", counted_compare)
    return counted


def _kind(layer) -> str:
    return "panel" if isinstance(layer, PanelLinear) else "prepacked" if isinstance(layer, PackedLinear) else "default"


def test_a_second_start_swaps_the_same_kernels_without_timing(demo_model_path, cache, timings):
    first = prepack_language(_load(demo_model_path), "auto", rows=(4, 64), head_rows=(1, 16), fuse=True)
    assert timings == {"linear": 2, "fused_mlp": 2}     # the stack, the head; the fused MLP at both rows
    assert first.reason == "measured" and first.head is not None and first.head.reason == "measured"
    assert len(list(cache.glob("linear-*.json"))) == 2 and len(list(cache.glob("fused_mlp-*.json"))) == 1

    lm = _load(demo_model_path)
    again = prepack_language(lm, "auto", rows=(4, 64), head_rows=(1, 16), fuse=True)
    assert timings == {"linear": 2, "fused_mlp": 2}     # nothing timed
    for got, want in ((again, first), (again.head, first.head)):
        assert got is not None and want is not None
        assert (got.kernel, got.speedup, got.speedups, got.timings_ms, got.max_rel_diff) == \
               (want.kernel, want.speedup, want.speedups, want.timings_ms, want.max_rel_diff)
        assert got.reason.startswith("measured at ") and got.reason.endswith("kept (services/models/kernel_choices.py)")
    assert (again.num_swapped, again.num_fused, again.fused_speedup) == \
           (first.num_swapped, first.num_fused, first.fused_speedup)
    assert _kind(lm.model.layers[0].self_attn.q_proj) == again.kernel and _kind(lm.lm_head) == again.head.kernel


def test_other_rows_threads_or_code_time_again(demo_model_path, cache, timings, monkeypatch):
    prepack_language(_load(demo_model_path), "auto", rows=(4, 64), head_rows=(1,))
    assert timings["linear"] == 2
    prepack_language(_load(demo_model_path), "auto", rows=(4, 32), head_rows=(1,))    # the head's is kept
    assert timings["linear"] == 3
    before = torch.get_num_threads()
    torch.set_num_threads(1 if before > 1 else 2)
    try:
        prepack_language(_load(demo_model_path), "auto", rows=(4, 32), head_rows=(1,))
    finally:
        torch.set_num_threads(before)
    assert timings["linear"] == 5
    monkeypatch.setattr(kernel_choices, "_machine_and_code", lambda: {"torch": "other", "cpu": {}, "code": "x"})
    prepack_language(_load(demo_model_path), "auto", rows=(4, 32), head_rows=(1,))
    assert timings["linear"] == 7
    assert len(list(cache.glob("linear-*.json"))) == 7


def test_a_kept_file_that_cannot_be_trusted_is_timed_over(demo_model_path, cache, timings, caplog):
    lm = _load(demo_model_path)
    prepack_language(lm, "auto", rows=(4,), head_rows=(1,))
    files = sorted(cache.glob("linear-*.json"))
    assert timings["linear"] == 2 and len(files) == 2
    stack = next(f for f in files if json.loads(f.read_text())["what"]["shapes"][0][0] != "lm_head")
    caplog.set_level(logging.WARNING, logger=kernel_choices.__name__)

    stack.write_text("{not json")
    prepack_language(_load(demo_model_path), "auto", rows=(4,), head_rows=(1,))
    assert timings["linear"] == 3 and "unreadable" in caplog.text
    assert json.loads(stack.read_text())["decision"]["reason"] == "measured"     # written again, whole

    record = json.loads(stack.read_text())
    record["decision"]["kernel"] = "bogus"
    stack.write_text(json.dumps(record))
    report = prepack_language(_load(demo_model_path), "auto", rows=(4,), head_rows=(1,))
    assert timings["linear"] == 4 and report.kernel in ("panel", "prepacked", "default")
    assert "holds no decision this version makes" in caplog.text

    if os.geteuid() == 0:
        os.chown(stack, 12345, 12345)
        prepack_language(_load(demo_model_path), "auto", rows=(4,), head_rows=(1,))
        assert timings["linear"] == 5 and "belongs to another user" in caplog.text


def test_a_folder_that_cannot_be_written_only_costs_the_timing(demo_model_path, tmp_path, monkeypatch, timings,
                                                                 caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("EPD_CACHE_DIR", str(blocked))      # the folder would be under a file
    caplog.set_level(logging.WARNING, logger=kernel_choices.__name__)
    for expected in (2, 4):
        report = prepack_language(_load(demo_model_path), "auto", rows=(4,), head_rows=(1,))
        assert report.reason == "measured" and timings["linear"] == expected
    assert "not kept" in caplog.text and list(tmp_path.iterdir()) == [blocked]


def test_fused_mlps_keep_their_decision(demo_model_path, cache, timings):
    first = fused_mlp.fuse_mlps(_load(demo_model_path).model, "auto", rows=(8, 64))
    model = _load(demo_model_path).model
    again = fused_mlp.fuse_mlps(model, "auto", rows=(8, 64))
    assert timings["fused_mlp"] == 2 and (again.speedup, again.max_rel_diff) == (first.speedup, first.max_rel_diff)
    assert again.gated == first.gated and again.reason == first.reason
    assert isinstance(model.layers[0].mlp, fused_mlp.FusedGatedMLP) == bool(first.gated)


def test_two_processes_starting_together_time_once(demo_model_path, cache):
    """Two roles of one model start at once: one times under the lock, the other finds its decision there."""
    code = textwrap.dedent(f"""
        from services.models.prepack import prepack_language
        from services.models.registry import adapter_for
        path = {str(demo_model_path)!r}
        report = prepack_language(adapter_for(path).load_language(path, "cpu", "float32", 512), "auto",
                                  rows=(4, 64), head_rows=(1,))
        print(report.kernel, report.reason)
    """)
    env = {**os.environ, "EPD_CACHE_DIR": str(cache.parent)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [proc.communicate(timeout=300)[0].strip() for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), outs
    reasons = sorted(out.split(" ", 1)[1] for out in outs)
    kept = "kept (services/models/kernel_choices.py)"
    assert reasons[0] == "measured" and reasons[1].startswith("measured at ") and reasons[1].endswith(kept)
    assert len({out.split(" ", 1)[0] for out in outs}) == 1


def test_a_timing_beside_another_is_not_kept(demo_model_path, cache, timings, monkeypatch, tmp_path):
    """The timing lock's wait ran out (another process held it): auto times anyway, beside that process, and a
    decision measured so is used but not kept."""
    from services.models import timing_lock
    from tests.support.timing_holder import lock_held

    with lock_held(tmp_path):
        monkeypatch.setattr(timing_lock, "_LOCK_WAIT_S", 0.2)
        report = prepack_language(_load(demo_model_path), "auto", rows=(4,), head_rows=(1,))
        assert report.reason == "measured" and timings["linear"] == 2 and not list(cache.glob("*.json"))
    prepack_language(_load(demo_model_path), "auto", rows=(4,), head_rows=(1,))     # the lock free again: kept
    assert timings["linear"] == 4 and len(list(cache.glob("linear-*.json"))) == 2
