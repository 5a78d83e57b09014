"""PrefillEngine: result shapes and dtypes, agreement with the full model, and item validation."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from services.generation.params import DecodeParams
from services.kernels import loader
from services.models.base import MultiModalInput
from services.prefill.engine import PrefillEngine
from tests.services.models.helpers import CHATS, encode_items, mm_inputs, processor_inputs


@pytest.fixture(scope="module")
def parts(demo_model_path):
    from services.models.registry import adapter_for

    adapter = adapter_for(demo_model_path)
    return adapter.load_vision(demo_model_path), adapter.load_language(demo_model_path)


@pytest.fixture(scope="module")
def image_prompt(demo_model_path, parts):
    """(token_ids, items) of the one-image chat, embeddings included."""
    from services.models.processing import load_processor

    inputs = processor_inputs(load_processor(demo_model_path), CHATS["one_image"]())
    token_ids = inputs["input_ids"][0].tolist()
    items = encode_items(inputs)
    return inputs, token_ids, mm_inputs(token_ids, items, parts[0].encode(items))


def test_result_shapes_and_dtypes(parts, image_prompt):
    _, lm = parts
    _, token_ids, items = image_prompt
    result = PrefillEngine(lm).prefill(token_ids, items)
    layout = lm.layout
    assert result.kv.shape == (layout.num_layers, 2, layout.num_kv_heads, len(token_ids), layout.head_dim)
    assert result.kv.dtype == layout.dtype == torch.float32
    assert result.first_logits.shape == (lm.vocab_size,) and result.first_logits.dtype == torch.float32
    assert result.num_prompt_tokens == len(token_ids)
    assert result.rope_delta == -240  # 256 image tokens take 16 positions


def test_matches_the_full_model_forward(demo_model_path, parts, image_prompt):
    from transformers import Qwen2VLForConditionalGeneration

    inputs, token_ids, items = image_prompt
    full = Qwen2VLForConditionalGeneration.from_pretrained(str(demo_model_path)).eval()
    with torch.no_grad():
        out = full(**inputs, use_cache=True)
    result = PrefillEngine(parts[1]).prefill(token_ids, items)
    torch.testing.assert_close(result.first_logits, out.logits[0, -1], rtol=0, atol=1e-5)
    for index, layer in enumerate(out.cache.layers):
        torch.testing.assert_close(result.kv[index, 0], layer.keys[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(result.kv[index, 1], layer.values[0], rtol=0, atol=1e-5)


def test_text_prompt_needs_no_items(parts):
    result = PrefillEngine(parts[1]).prefill([151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198])
    assert result.rope_delta == 0 and result.kv.shape[3] == 9


def test_bfloat16_keeps_kv_in_model_dtype(demo_model_path, parts, image_prompt):
    from services.models.registry import adapter_for

    _, token_ids, items = image_prompt
    lm16 = adapter_for(demo_model_path).load_language(demo_model_path, "cpu", "bfloat16")
    result = PrefillEngine(lm16).prefill(token_ids, items)
    assert lm16.layout.dtype == torch.bfloat16 and result.kv.dtype == torch.bfloat16
    assert result.first_logits.dtype == torch.float32


def shifted(item: MultiModalInput, by: int) -> MultiModalInput:
    return dataclasses.replace(item, offset=item.offset + by)


BAD_ITEMS = {
    "range starts on vision_start": lambda item: [shifted(item, -1)],
    "range runs past the image": lambda item: [shifted(item, 1)],
    "embedding rows != length": lambda item: [dataclasses.replace(item, embedding=item.embedding[:-1])],
    "length != grid tokens": lambda item: [dataclasses.replace(item, length=item.length - 1,
                                                               embedding=item.embedding[:-1])],
    "image tokens not covered": lambda item: [],
    "range outside prompt": lambda item: [dataclasses.replace(item, offset=10_000)],
    "video modality": lambda item: [dataclasses.replace(item, modality="video")],
    "missing grid": lambda item: [dataclasses.replace(item, metadata={})],
}


@pytest.mark.parametrize("case", sorted(BAD_ITEMS))
def test_bad_placeholder_range_is_a_value_error(parts, image_prompt, case):
    _, token_ids, items = image_prompt
    with pytest.raises(ValueError) as caught:
        PrefillEngine(parts[1]).prefill(token_ids, BAD_ITEMS[case](items[0]))
    assert "item" in str(caught.value) or "placeholder" in str(caught.value)


def test_a_video_placeholder_without_its_item_is_refused(parts):
    with pytest.raises(ValueError, match="1 video placeholder tokens but the items cover 0"):
        PrefillEngine(parts[1]).prefill([151644, 151652, 151656, 151653, 151645])


def test_concurrent_prefills_are_serialised_and_correct(parts, image_prompt):
    _, token_ids, items = image_prompt
    engine = PrefillEngine(parts[1])
    expected = engine.prefill(token_ids, items)
    results: list = [None] * 4

    def call(index: int) -> None:
        results[index] = engine.prefill(token_ids, items)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert all(torch.equal(r.kv, expected.kv) for r in results)
    assert engine.num_prefills == 5


def _greedy_beside_plain(engine: PrefillEngine, token_ids: list[int], items: list) -> tuple:
    """An image prompt and a text prompt, each submitted greedy and not, in one batch: the greedy ones carry
    the argmax of the plain ones' logits and no logits; returns the plain (image, text) results."""
    text = token_ids[:5] + token_ids[-6:]
    futures = [engine.submit(token_ids, items, greedy=True), engine.submit(text, greedy=True),
               engine.submit(token_ids, items), engine.submit(text)]
    greedy_image, greedy_text, image, plain_text = (future.result(60) for future in futures)
    for held in (greedy_image, greedy_text, image, plain_text):
        held.release()
    assert greedy_image.first_logits is None and greedy_text.first_logits is None
    assert greedy_image.first_tokens == [int(image.first_logits.argmax())]
    assert greedy_text.first_tokens == [int(plain_text.first_logits.argmax())]
    return image, plain_text


def test_greedy_prompts_take_the_lm_head_screen(demo_model_path, parts, image_prompt):
    """A prompt submitted `greedy` gets its first token from the LM head screen (services/models/head_screen.py)
    when the head runs on float32 panels: the full head's argmax, no logits; in the same batch a prompt that
    is not greedy gets its logits; with a plain head the screen is off and says why."""
    from services.models.prepack import prepack_language
    from services.models.registry import adapter_for

    _, token_ids, items = image_prompt
    assert PrefillEngine(parts[1]).screen_report.line() == (
        "lm head screen off (the LM head screen needs a float32 panel head)")
    lm = adapter_for(demo_model_path).load_language(demo_model_path)
    prepack_language(lm, "panel")
    assert PrefillEngine(lm).screen_report.line() == "lm head screen off (hidden size 64 < 256: not worth it (auto))"
    engine = PrefillEngine(lm, lm_head_screen="on")
    assert engine.screen is not None, engine.screen_report.line()
    image, plain_text = _greedy_beside_plain(engine, token_ids, items)
    assert image.first_tokens is None and engine.screen.rows_screened == 2


def test_without_the_screen_a_greedy_prompt_gets_its_argmax_from_the_engine_thread(parts, image_prompt):
    """With the LM head screen off, a `greedy` prompt's first token is still decided on the engine thread (the
    full head's argmax, ties to the first index, as the sampler's greedy pick), so no [vocab] logits row goes
    back to the caller; a prompt that is not greedy gets its logits, and both agree."""
    _, token_ids, items = image_prompt
    engine = PrefillEngine(parts[1])
    assert engine.screen is None
    image, plain_text = _greedy_beside_plain(engine, token_ids, items)
    assert image.first_tokens is None and plain_text.first_tokens is None


def test_a_chunked_prompt_runs_on_its_own_thread_count_and_idle_clears_the_board(parts, monkeypatch):
    """--role-threads prefill-long=1 (compute_threads.LONG_ENV): a prompt longer than the token budget runs its
    chunks on that many torch threads, a short one on the role's count; once the engine idles, its byte on the
    long-prompt board (decode follows it, services/hostcpu/role_cpu.py) is cleared."""
    from services.hostcpu import compute_threads, role_cpu

    monkeypatch.setenv(compute_threads.ENV, "2")
    monkeypatch.setenv(compute_threads.LONG_ENV, "1")
    monkeypatch.setattr(compute_threads, "SMALL_FORWARD_FLOPS", 0.0)  # no forward counts as small here
    board = bytearray(4)
    monkeypatch.setattr(role_cpu, "_LONG", {"map": board, "slot": 2})
    monkeypatch.setattr(role_cpu, "_GROUP", {})
    lm = parts[1]
    seen: list[int] = []
    hook = lm.model.layers[0].register_forward_hook(lambda *args: seen.append(torch.get_num_threads()))
    engine = PrefillEngine(lm, max_num_batched_tokens=32, idle_exit_s=30.0)
    marked = []
    try:
        engine.submit(list(range(1000, 1100)), on_finish=lambda held: marked.append(board[2])).result(60).release()
        long_chunks, seen[:] = list(seen), []
        engine.submit(list(range(1000, 1010))).result(60).release()
        short = list(seen)
        for _ in range(100):       # the engine goes idle right after
            if board[2] == 0:
                break
            threading.Event().wait(0.02)
    finally:
        hook.remove()
        engine.close()
    assert long_chunks == [1, 1, 1, 1] and short == [2] and marked == [1] and board[2] == 0


@pytest.mark.skipif(not loader.expected("head_int8"),
                    reason="this CPU has no AVX512-VNNI: the int8 kernel is not built")
def test_temperature_first_tokens_are_drawn_through_the_screen(demo_model_path, image_prompt):
    """A prompt whose samples' params are all plain sampled gets each sample's first token drawn through the LM
    head screen (services/sampling/screened.py) and no logits; a seed gives the same tokens again; params that
    need the logits (top-p, min_tokens) are not drawn there."""
    from services.models.prepack import prepack_language
    from services.models.registry import adapter_for

    _, token_ids, items = image_prompt
    lm = adapter_for(demo_model_path).load_language(demo_model_path)
    prepack_language(lm, "panel")
    engine = PrefillEngine(lm, lm_head_screen="on")
    draws = [DecodeParams(temperature=0.8, seed=21 + i) for i in range(3)]
    assert engine.can_draw(draws)
    assert not engine.can_draw([DecodeParams(temperature=0.8, top_p=0.9)])
    assert not engine.can_draw([DecodeParams(temperature=0.8, min_tokens=2)])
    assert not engine.can_draw([DecodeParams(temperature=0.8, logprobs=1)])
    runs = [engine.submit(token_ids, items, draws=draws).result(60) for _ in range(2)]
    for held in runs:
        held.release()
        assert held.first_logits is None and len(held.first_tokens) == 3
        assert all(0 <= token < lm.vocab_size for token in held.first_tokens)
    assert runs[0].first_tokens == runs[1].first_tokens
    assert engine.screen.rows_screened == 6 and engine.screen.rows_full == 0


def test_a_forward_waits_for_decode_to_send_the_first_tokens_handed_off_before_it(parts, tmp_path, monkeypatch):
    """Decode's turn (services/hostcpu/compute_lease.py): a prompt's first token handed to decode is counted, and
    the next forward starts only once decode has sent it on; a prompt that hands nothing off counts nothing."""
    import struct
    import time

    from services.hostcpu import compute_lease

    path = compute_lease.create(str(tmp_path / "lease"))
    monkeypatch.setattr(compute_lease, "_LEASE", [compute_lease.ComputeLease(path, 0)])
    monkeypatch.setattr(compute_lease, "TURN_S", 5.0)
    decode = compute_lease.Follower(path)

    def counts() -> tuple[int, int]:
        return struct.unpack_from("<qq", decode.board, compute_lease.HANDED)

    engine = PrefillEngine(parts[1])
    ids = list(range(10, 40))
    try:
        engine.submit(ids, hands_off=True).result(timeout=60).release()
        assert counts() == (1, 0)
        sender = threading.Timer(0.3, decode.sent_first_token)
        began = time.monotonic()
        sender.start()
        engine.submit(ids, hands_off=False).result(timeout=60).release()   # waited for decode's turn
        assert time.monotonic() - began >= 0.29 and counts() == (1, 1)
        sender.join()
        began = time.monotonic()
        engine.submit(ids).result(timeout=60).release()   # nothing handed off: no turn to wait for
        assert time.monotonic() - began < 0.29 and counts() == (1, 1)
    finally:
        engine.close()
        compute_lease._LEASE[0].close()
