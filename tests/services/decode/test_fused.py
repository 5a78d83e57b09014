"""The fused decode step (services/decode/fused.py): the same logits and pool writes as the eager paged
forward and as Hugging Face, identical greedy tokens through the engine on one and two threads, the
negative controls (a wrong rope position or a wrong length) still caught, and a clear refusal where it
does not apply."""

from __future__ import annotations

import pytest
import torch

from services.decode.attention import TorchPagedAttention
from services.decode.block_pool import BlockPool
from services.decode.fused import FusedStep, choose_fused, unsupported_reason
from services.decode.paged_forward import PagedDecoder
from tests.services.decode.conftest import GREEDY, StepBatch, hf_first_step_logits


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("threads", [1, 2])
@torch.inference_mode()
def test_fused_logits_and_pool_writes_match_the_eager_step_and_hf(tiny, prefilled, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        eager, fused = StepBatch(tiny, prefilled), StepBatch(tiny, prefilled)
        want = eager.decoder.forward(*eager.inputs)
        got = FusedStep(fused.decoder, max_rows=4)(*fused.inputs)
    finally:
        torch.set_num_threads(before)
    assert got.shape == want.shape == (len(prefilled), want.shape[-1])
    assert _rel(got, want) <= 1e-5
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert _rel(fused.new_kv(), eager.new_kv()) <= 1e-5        # the same K/V, at the same (block, offset)
    for row, pre in enumerate(prefilled):
        assert _rel(got[row], hf_first_step_logits(tiny, pre)) <= 1e-4


@torch.inference_mode()
def test_a_wrong_rope_position_or_length_is_caught(tiny, prefilled):
    want = torch.stack([hf_first_step_logits(tiny, pre) for pre in prefilled])
    shifted = StepBatch(tiny, prefilled, position_shift=1)
    assert _rel(FusedStep(shifted.decoder, 4)(*shifted.inputs), want) > 1e-3
    short = StepBatch(tiny, prefilled, len_shift=-1)      # each row misses its newest token
    assert _rel(FusedStep(short.decoder, 4)(*short.inputs), want) > 1e-3


@pytest.mark.parametrize("serial_rows", [0, 4])
def test_the_engine_runs_fused_and_gives_generate_tokens(tiny, make_engine, prefilled, submit, serial_rows):
    if torch.get_num_threads() < 2:
        torch.set_num_threads(2)
    engine = make_engine(num_slots=4, block_size=8, serial_rows=serial_rows)
    assert engine.stats().step_mode == "fused"
    assert "decode step fused (--decode-fused auto: the decoder stack in one C call)" in engine.describe()
    assert engine._runner.serial_rows == serial_rows
    own = make_engine(num_slots=4, block_size=8, serial_rows=4, fused_serial_rows=0)   # as the decode role builds it
    assert own._runner.serial_rows == 0 and "(steps of <= 0 rows on 1)" in own.describe()
    unfused = make_engine(num_slots=4, block_size=8, serial_rows=4, fused="off", fused_serial_rows=0)
    assert unfused._runner.serial_rows == 4
    sinks = [submit(engine, f"f{i}", p, max_tokens=24, **GREEDY) for i, p in enumerate(prefilled)]
    for sink, pre in zip(sinks, prefilled, strict=True):
        sink.wait_done()
        assert sink.token_ids == tiny.reference(pre, 24)
    assert engine.stats().steps > 0 and engine.stats().step_mode == "fused"


def test_it_is_refused_clearly_where_it_does_not_apply(tiny):
    from services.models.prepack import prepack_language
    from services.models.registry import adapter_for

    plain = adapter_for(tiny.path).load_language(tiny.path, "cpu", "float32", 512)   # F.linear, no panels
    pool = BlockPool(plain.layout, 4 << 20, block_size=16)
    decoder = PagedDecoder(plain, pool, TorchPagedAttention())
    assert unsupported_reason(decoder) == "layer 0's linears are not panel layers (--linear-kernel panel)"
    assert choose_fused(decoder, "auto", 4) == (None, unsupported_reason(decoder))
    with pytest.raises(ValueError, match="--decode-fused on: layer 0's linears are not panel layers"):
        choose_fused(decoder, "on", 4)
    with pytest.raises(ValueError, match="unknown fused decode mode 'fast'; supported: auto, on, off"):
        choose_fused(decoder, "fast", 4)
    prepack_language(plain, "panel")
    panel_decoder = PagedDecoder(plain, pool, decoder.attention)
    assert unsupported_reason(panel_decoder) == ""
    assert choose_fused(panel_decoder, "off", 4) == (None, "off")
    step = FusedStep(panel_decoder, max_rows=2)
    with pytest.raises(ValueError, match="a fused step takes at most 2 rows, got 3"):
        step(*(torch.zeros(3, dtype=torch.int64),) * 4, torch.zeros((3, 1), dtype=torch.int32),
             torch.ones(3, dtype=torch.int32))


def test_fused_off_runs_the_eager_step(tiny, make_engine):
    engine = make_engine(num_slots=2, fused="off")
    assert engine.stats().step_mode == "eager"
    assert engine.step_report.line() == "decode step eager (--decode-fused off)"


def test_decode_role_steers_auto_to_panels_for_the_fused_step():
    from services.config import EpdConfig
    from services.decode.app import stack_kernel
    from services.models import panel_linear

    assert stack_kernel(EpdConfig.of(linear_kernel="auto")) == ("panel" if panel_linear.available() else "auto")
    assert stack_kernel(EpdConfig.of(linear_kernel="auto", decode_fused="off")) == "auto"
    assert stack_kernel(EpdConfig.of(linear_kernel="prepacked")) == "prepacked"
    # --dtype bfloat16: float32 activations over bfloat16 panels, so the fused step still applies ...
    assert stack_kernel(EpdConfig.of(linear_kernel="auto", dtype="bfloat16")) == (
        "panel" if panel_linear.available(torch.bfloat16) else "auto")
    # ... unless the kernels are refused: then the model is loaded in bfloat16 and runs unswapped
    assert stack_kernel(EpdConfig.of(linear_kernel="default", dtype="bfloat16")) == "default"
    with pytest.raises(ValueError, match="decode_fused must be one of auto, on, off"):
        EpdConfig.of(decode_fused="maybe")


@torch.inference_mode()
def test_bfloat16_panels_run_fused_as_float32_over_the_rounded_weights(tiny, prefilled):
    """decode's --dtype bfloat16: the fused step over bfloat16 panels gives the logits of the eager step over
    the same weights rounded to bfloat16 and kept in float32 (1e-5), visibly not the unrounded model's
    (the rounding really happened), and the same greedy tokens as that rounded eager step."""
    from types import SimpleNamespace

    from services.models.panel_linear import PanelLinear
    from services.models.prepack import prepack_language
    from services.models.registry import adapter_for

    def load(round_weights: bool):
        lm = adapter_for(tiny.path).load_language(tiny.path, "cpu", "float32", 512)
        if round_weights:
            for module in lm.model.modules():
                if isinstance(module, torch.nn.Linear):
                    module.weight.copy_(module.weight.to(torch.bfloat16).float())
        return lm

    bf16 = load(False)
    report = prepack_language(bf16, "panel", weight_dtype=torch.bfloat16)
    layer = bf16.model.layers[0]
    assert isinstance(layer.mlp.down_proj, PanelLinear) and layer.mlp.down_proj.weight.dtype == torch.bfloat16
    assert report.kernel == "panel" and bf16.layout.dtype == torch.float32
    rounded, exact = load(True), load(False)
    prepack_language(rounded, "panel")    # float32 panels of the rounded weights
    prepack_language(exact, "panel")
    # one LM head for all three (bf16 panels), so the logits differ only by the decoder stacks
    for lm in (rounded, exact):
        lm.lm_head = bf16.lm_head
    got_batch = StepBatch(SimpleNamespace(lm=bf16), prefilled)
    got = FusedStep(got_batch.decoder, max_rows=4)(*got_batch.inputs)
    want_batch = StepBatch(SimpleNamespace(lm=rounded), prefilled)
    want = want_batch.decoder.forward(*want_batch.inputs)
    off_batch = StepBatch(SimpleNamespace(lm=exact), prefilled)
    off = off_batch.decoder.forward(*off_batch.inputs)
    assert _rel(got, want) <= 1e-5
    assert _rel(got_batch.new_kv(), want_batch.new_kv()) <= 1e-5
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert _rel(got, off) > 1e-5


def test_the_decode_role_keeps_float32_activations_over_bfloat16_weights():
    from services.config import EpdConfig
    from services.decode.app import bf16_weights, load_dtype, wants_fused
    from services.models import panel_linear

    bf16 = EpdConfig.of(dtype="bfloat16")
    assert bf16_weights(bf16) == panel_linear.available(torch.bfloat16)
    assert load_dtype(bf16) == ("float32" if bf16_weights(bf16) else "bfloat16")
    assert wants_fused(bf16) == bf16_weights(bf16)
    assert not bf16_weights(EpdConfig.of(dtype="bfloat16", linear_kernel="default"))   # no swap: bf16 throughout
    assert load_dtype(EpdConfig.of(dtype="bfloat16", linear_kernel="default")) == "bfloat16"
    assert not bf16_weights(EpdConfig())


def test_a_bfloat16_prefill_kv_is_widened_into_float32_blocks(tiny, make_engine, prefilled, submit):
    """A bfloat16 prefill beside a float32-activation decode: the KV lands widened (exactly), so the tokens are
    those of the same KV handed over as float32; a dtype that does not widen exactly is refused."""
    from dataclasses import replace

    from services.protocol.errors import InvalidRequest

    engine = make_engine(num_slots=2, block_size=8)
    halved = [replace(p, kv=p.kv.to(torch.bfloat16)) for p in prefilled[1:]]
    widened = [replace(p, kv=p.kv.float()) for p in halved]
    got = [submit(engine, f"h{i}", p, max_tokens=8, **GREEDY) for i, p in enumerate(halved)]
    want = [submit(engine, f"w{i}", p, max_tokens=8, **GREEDY) for i, p in enumerate(widened)]
    for a, b in zip(got, want, strict=True):
        a.wait_done(), b.wait_done()
        assert a.token_ids == b.token_ids and len(a.token_ids) == 8
    with pytest.raises(InvalidRequest, match="kv dtype must be the model dtype torch.float32, got torch.float64"):
        engine.check_prefill(prefilled[0].kv.double(), prefilled[0].prompt_len)
