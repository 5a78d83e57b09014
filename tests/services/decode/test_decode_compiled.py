"""The compiled decode step (services/decode/compiled.py) on the tiny model.

One engine with a single compiled bucket (4 rows) is built once for the module, compiling cold into an
Inductor cache folder made for this test session; later engines in the session find it warm.  Every
step with 1..3 rows runs that graph with padding rows, so the padding is exercised throughout.
Exactness is checked against Hugging Face `generate` (tokens) and its first-step logits (1e-4), and
the negative controls (a rope position off by one, a mask hiding the newest token) must still fail
with the compiled step.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from PIL import Image
from test_decode_paged import _DropNewest, _rel  # this folder's helpers (rootdir import)

from services.decode.compiled import STEP_MODES, choose_step, pad_inputs
from tests.services.decode.conftest import GREEDY, PROMPTS, hf_first_step_logits

ROWS = 4


@pytest.fixture(scope="module")
def inductor_cache(tmp_path_factory):
    """A cache folder of this session: the first compile is cold, later ones in the session warm."""
    folder = tmp_path_factory.mktemp("inductor")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(folder))
        yield folder


@pytest.fixture(scope="module")
def prefilled(tiny):
    pixels = (np.random.RandomState(0).rand(56, 84, 3) * 255).astype("uint8")
    image = tiny.prefill_image("Describe the picture.", Image.fromarray(pixels))
    assert image.rope_delta != 0
    return [tiny.prefill_text(tiny.chat_ids(p)) for p in PROMPTS] + [image]


@pytest.fixture(scope="module")
def engine(tiny, inductor_cache):
    from services.decode.engine import DecodeEngine

    engine = DecodeEngine(tiny.lm, tiny.tokenizer, ROWS, 512, step="compiled", step_buckets=(ROWS,))
    yield engine
    engine.close()


def test_compiled_step_gives_generate_tokens_with_padded_rows(tiny, engine, prefilled, submit, inductor_cache):
    report = engine.step_report
    assert (report.mode, report.compiled_buckets, engine.stats().step_mode) == ("compiled", (ROWS,), "compiled")
    assert report.buckets[ROWS].max_rel_diff <= 1e-4 and report.buckets[ROWS].compile_s > 0
    assert any(p.is_file() for p in (inductor_cache / "fxgraph").rglob("*"))   # the graph persists for a next start
    assert "decode step compiled" in engine.describe()
    before = engine.stats()
    first = submit(engine, "c0", prefilled[0], max_tokens=20, **GREEDY)
    first.wait_tokens(5)                               # one row alone for a while: 3 padding rows
    sinks = [first] + [submit(engine, f"c{i}", p, max_tokens=24, **GREEDY) for i, p in enumerate(prefilled) if i]
    for i, (sink, pre) in enumerate(zip(sinks, prefilled, strict=True)):
        sink.wait_done(timeout=120)
        assert sink.token_ids == tiny.reference(pre, 20 if i == 0 else 24), f"request {i}"
    stats = engine.stats()
    steps = stats.steps - before.steps
    assert steps > 24 and stats.compiled_steps - before.compiled_steps == steps     # every step ran the graph
    assert (stats.kv.used_blocks, stats.kv.reserved_blocks) == (0, 0)


def _loaded(engine, pre):
    blocks = engine.reserve(pre.prompt_len)
    engine.load(blocks, pre.kv, pre.prompt_len)
    return blocks


def test_padding_rows_write_only_the_scratch_block(engine, prefilled):
    from services.decode.params import DecodeParams
    from services.decode.sampler import RowSampling

    runner, pool = engine._runner, engine.pool      # the engine is idle: its thread never touches the runner
    pre = prefilled[1]
    pool.kv.zero_()            # so a block the step takes (zeroed when taken) shows no change of its own
    blocks = _loaded(engine, pre)
    try:
        runner.place(0, blocks)
        scratch = pool.scratch_block
        before = pool.kv.clone()
        steps = engine.stats().compiled_steps
        runner.step([pre.first_token], [pre.rope_delta], [blocks], [RowSampling(DecodeParams(**GREEDY))])
        assert runner.compiled_steps == steps + 1
        block, offset = blocks.blocks[-1], (blocks.num_tokens - 1) % pool.block_size
        changed = (pool.kv != before).any(dim=(0, 1, 3, 5))                        # [blocks, offsets]
        assert changed[block, offset] and changed[scratch, 0]       # the real row's slot, the padding's slot
        changed[block, offset] = changed[scratch, 0] = False
        assert not changed.any(), f"padding wrote elsewhere: {changed.nonzero().tolist()}"
        assert runner.tables[1:ROWS, 0].tolist() == [scratch] * (ROWS - 1)
    finally:
        blocks.release()


def _compiled_first_step(engine, pre, position_shift: int = 0) -> torch.Tensor:
    """Logits of the first decode step of `pre` as row 0 of a compiled step of ROWS rows (3 padding).
    Inputs are made outside inference mode, as the runner's buffers are (the graph's guards say so)."""
    runner, pool = engine._runner, engine.pool
    blocks = _loaded(engine, pre)
    try:
        position = blocks.num_tokens
        block, offset, _ = blocks.append_slot()
        ids, positions, write_blocks, write_offsets, tables, lens = inputs = pad_inputs(
            ROWS, ROWS, runner.max_blocks, pool.scratch_block, runner.device)
        ids[0], positions[0] = pre.first_token, position + pre.rope_delta + position_shift
        write_blocks[0], write_offsets[0], lens[0] = block, offset, blocks.num_tokens
        tables[0, :len(blocks.blocks)] = torch.tensor(blocks.blocks, dtype=torch.int32)
        with torch.inference_mode():
            logits = runner.compiled(*inputs)
        assert logits is not None
        return logits[0].clone()
    finally:
        blocks.release()


def test_compiled_logits_match_hf_within_1e4_and_the_negative_controls_fail(tiny, engine, prefilled):
    decoder = engine._runner.decoder
    for pre in prefilled:
        want = hf_first_step_logits(tiny, pre)
        assert _rel(_compiled_first_step(engine, pre), want) <= 1e-4
        assert _rel(_compiled_first_step(engine, pre, position_shift=1), want) > 1e-3
        kernel = decoder.attention
        decoder.attention = _DropNewest(kernel)     # the graph's attention op calls whatever the decoder holds
        try:
            assert _rel(_compiled_first_step(engine, pre), want) > 1e-3
        finally:
            decoder.attention = kernel


def test_auto_times_both_on_a_warm_cache_and_reports_them(tiny, engine, inductor_cache):
    from prometheus_client import REGISTRY

    from services.decode.engine import DecodeEngine
    from services.decode.metrics import export_info

    with DecodeEngine(tiny.lm, tiny.tokenizer, ROWS, 512, step="auto", step_buckets=(ROWS,), fused="off",
                      compile_budget_s=600) as auto:
        result = auto.step_report.buckets[ROWS]
        assert result.eager_ms > 0 and result.compiled_ms > 0 and result.max_rel_diff <= 1e-4
        faster = result.eager_ms >= 1.03 * result.compiled_ms
        assert result.mode == ("compiled" if faster else "eager")
        assert auto.stats().step_mode == result.mode and auto.step_report.reason == "measured"
        assert f"{ROWS}: {result.mode} eager {result.eager_ms:.2f} ms / compiled" in auto.describe()
        export_info(auto.stats(), auto.step_report)
        sample = REGISTRY.get_sample_value
        assert sample("epd_decode_step_bucket_info", {"bucket": str(ROWS), "mode": result.mode}) == 1
        assert sample("epd_decode_step_startup_ms", {"bucket": str(ROWS), "mode": "compiled"}) == result.compiled_ms
        assert sample("epd_decode_step_mode_info", {"mode": result.mode}) == 1


def test_auto_with_no_budget_left_runs_eager_and_says_so(tiny):
    from services.decode.engine import DecodeEngine

    with DecodeEngine(tiny.lm, tiny.tokenizer, ROWS, 512, step="auto", compile_budget_s=0, fused="off") as auto:
        report = auto.step_report
        assert (report.mode, report.compiled_buckets) == ("eager", ())
        assert report.reason == "compile budget 0 s spent; eager"
        assert [r.note for r in report.buckets.values()] == ["budget spent"] * 3 and list(report.buckets) == [1, 2, 4]


def test_a_graph_that_cannot_compile_falls_back_to_eager_with_one_log_line(caplog):
    def forward(x: torch.Tensor) -> torch.Tensor:   # data-dependent Python branch: fullgraph tracing refuses it
        return x * 2 if x.sum().item() > 0 else x

    with caplog.at_level(logging.ERROR, logger="services.decode.compiled"):
        step, report = choose_step(forward, "compiled", (2,), lambda b: (torch.ones(b),))
    assert (report.mode, step.bucket_for(1), step.enabled) == ("eager", None, False)
    assert report.buckets[2].note.startswith("compile failed: ") and report.reason == report.buckets[2].note
    assert len(caplog.records) == 1 and "running eager" in caplog.records[0].getMessage()


def test_a_step_that_would_recompile_turns_compiled_off_and_runs_eager(tiny, engine, prefilled, submit, caplog):
    runner = engine._runner
    other = pad_inputs(2, ROWS, runner.max_blocks, engine.pool.scratch_block, runner.device)   # no graph for 2
    with caplog.at_level(logging.ERROR, logger="services.decode.compiled"):
        assert runner.compiled(*other) is None
    assert "running eager from now on" in caplog.records[-1].getMessage()
    assert engine.stats().step_mode == "eager" and runner.compiled.bucket_for(1) is None
    before = engine.stats()
    sink = submit(engine, "after", prefilled[2], max_tokens=8, **GREEDY)
    sink.wait_done()
    assert sink.token_ids == tiny.reference(prefilled[2], 8)
    assert engine.stats().compiled_steps == before.compiled_steps


def test_compiled_artifacts_cache_under_epd_cache_dir_even_after_inductor_wrote_its_default(tmp_path, monkeypatch):
    import os

    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

    from services.decode.compiled import _inductor_default_dir, configure_cache

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    inductor_cache_dir()            # what importing Inductor does: it writes its default into the environment
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == _inductor_default_dir()
    monkeypatch.setenv("EPD_CACHE_DIR", str(tmp_path))
    assert configure_cache() == str(tmp_path / "inductor") == os.environ["TORCHINDUCTOR_CACHE_DIR"]
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "chosen"))     # the user's choice stays
    assert configure_cache() == str(tmp_path / "chosen")


def test_step_modes_match_the_config_flag():
    from services.config import DECODE_STEPS, EpdConfig

    assert DECODE_STEPS == STEP_MODES
    with pytest.raises(ValueError, match="decode_step must be one of auto, eager, compiled"):
        EpdConfig(decode_step="fast")
    with pytest.raises(ValueError, match="decode_step_buckets must be comma-separated integers in 1..decode_slots"):
        EpdConfig(decode_step_buckets="1,32", decode_slots=16)
