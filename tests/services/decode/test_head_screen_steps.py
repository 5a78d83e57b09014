"""Decode steps through the LM head screen (services/decode/runner.py): greedy rows take the screen, and get
Hugging Face generate's tokens; temperature rows take its exact draw (int8) and a seed gives the same tokens
again; a step with a row that needs every logit (logprobs, a penalty, top-p) runs the full head;
`--lm-head-screen off` gives the same greedy tokens without it."""

from __future__ import annotations

import pytest
import torch

from services.decode.metrics import ENGINE_GAUGES
from services.kernels import loader
from tests.services.decode.conftest import GREEDY


def test_greedy_rows_take_the_screen_and_get_generate_tokens(tiny, make_engine, prefilled, submit):
    if torch.get_num_threads() < 2:
        torch.set_num_threads(2)
    engine = make_engine(num_slots=4, block_size=8, lm_head_screen="on")   # the tiny head is below auto's size
    assert any(f"lm head screen on: {what} panels" in engine.describe() for what in ("int8", "bfloat16"))
    sinks = [submit(engine, f"s{i}", p, max_tokens=20, **GREEDY) for i, p in enumerate(prefilled)]
    for sink, pre in zip(sinks, prefilled, strict=True):
        sink.wait_done()
        assert sink.token_ids == tiny.reference(pre, 20)
    stats = engine.stats()
    assert stats.screened_rows >= 3 * 19 and stats.screen_full_rows == 0   # every decode step's every row
    assert stats.screened_rows <= stats.screen_candidates
    assert stats.screen_kernel in ("int8", "pairs", "widened") and stats.screen_kernel in engine.describe()
    assert ENGINE_GAUGES["epd_decode_lm_head_screen_int8"][1](stats) == (stats.screen_kernel == "int8")


def test_rows_needing_every_logit_run_the_full_head(tiny, make_engine, prefilled, submit):
    engine = make_engine(num_slots=4, block_size=8, lm_head_screen="on")
    logprobs = submit(engine, "lp", prefilled[0], max_tokens=6, logprobs=2, **GREEDY)
    logprobs.wait_done()
    penalty = submit(engine, "rp", prefilled[1], max_tokens=6, repetition_penalty=1.3, **GREEDY)
    penalty.wait_done()
    assert logprobs.token_ids == tiny.reference(prefilled[0], 6)
    assert engine.stats().screened_rows == 0                  # both ran alone: every step on the full head
    # beside a greedy row, a logprobs row sends the whole step to the full head
    mixed = [submit(engine, "g", prefilled[2], max_tokens=8, **GREEDY),
             submit(engine, "l", prefilled[1], max_tokens=8, logprobs=1, **GREEDY)]
    for sink, pre in zip(mixed, prefilled[2:0:-1], strict=True):
        sink.wait_done()
        assert sink.token_ids == tiny.reference(pre, 8)
    assert engine.stats().screened_rows < 7                   # only steps where the greedy row ran alone


def test_screen_off_gives_the_same_tokens_without_it(tiny, make_engine, prefilled, submit):
    engine = make_engine(num_slots=4, block_size=8, lm_head_screen="off")
    assert "lm head screen off (--lm-head-screen off)" in engine.describe()
    sinks = [submit(engine, f"o{i}", p, max_tokens=12, **GREEDY) for i, p in enumerate(prefilled)]
    for sink, pre in zip(sinks, prefilled, strict=True):
        sink.wait_done()
        assert sink.token_ids == tiny.reference(pre, 12)
    assert engine.stats().screened_rows == 0


@pytest.mark.skipif(not loader.expected("head_int8"),
                    reason="this CPU has no AVX512-VNNI: the int8 kernel is not built")
def test_temperature_rows_take_the_screens_draw_and_a_seed_repeats(tiny, make_engine, prefilled, submit):
    engine = make_engine(num_slots=4, block_size=8, lm_head_screen="on")
    runs = []
    for _ in range(2):
        sinks = [submit(engine, f"t{len(runs)}{i}", p, max_tokens=12, temperature=0.9, seed=40 + i, ignore_eos=True)
                 for i, p in enumerate(prefilled)]
        for sink in sinks:
            sink.wait_done()
        runs.append([sink.token_ids for sink in sinks])
    assert runs[0] == runs[1] and all(len(ids) == 12 for ids in runs[0])
    assert len({tuple(ids) for ids in runs[0]}) == len(prefilled)
    stats = engine.stats()
    assert stats.screened_rows >= 2 * len(prefilled) * 11 and stats.screen_full_rows == 0
    # top-p needs every logit: its steps run the full head
    top_p = submit(engine, "p", prefilled[0], max_tokens=6, temperature=0.9, top_p=0.9, seed=1)
    top_p.wait_done()
    assert engine.stats().screened_rows == stats.screened_rows
