"""DecodeEngine rules: first-token stops, stop ids, min_tokens, ignore_eos, abort, bounds, errors."""

from __future__ import annotations

import pytest
import torch

from services.decode.engine import DecodeEngine
from services.decode.errors import ContextTooLong, EngineClosed, EngineFull
from services.decode.params import DecodeParams
from services.protocol.errors import InvalidRequest

EOS = 151645
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def pre(tiny):
    return tiny.prefill_text(tiny.chat_ids("Name a fruit and describe its colour."))


@pytest.fixture(scope="module")
def ref(tiny, pre):
    return tiny.reference(pre, 16)


def _with_first(pre, token):
    return type(pre)(pre.kv, pre.prompt_len, pre.rope_delta, token, pre.inputs)


def test_first_token_goes_through_the_stop_checks(tiny, make_engine, pre, submit):
    engine = make_engine(num_slots=2)
    one = submit(engine, "one", pre, max_tokens=1, **GREEDY).wait_done()
    assert (one.token_ids, one.finish_reason, one.completion_tokens) == ([pre.first_token], "length", 1)
    assert one.text == tiny.tokenizer.decode([pre.first_token])
    eos = submit(engine, "eos", _with_first(pre, EOS), max_tokens=9, **GREEDY).wait_done()
    assert (eos.token_ids, eos.finish_reason, eos.stop_reason, eos.text) == ([EOS], "stop", None, "")
    stop_id = submit(engine, "sid", pre, stop_token_ids=[pre.first_token], **GREEDY).wait_done()
    assert (stop_id.finish_reason, stop_id.stop_reason) == ("stop", pre.first_token)
    assert engine.stats().steps == 0              # none of them needed a slot or a forward


def test_stop_token_ids_and_min_tokens(make_engine, pre, ref, submit):
    index = next(i for i in range(1, len(ref)) if ref[i] not in ref[:i])
    engine = make_engine(num_slots=2)
    stop = {"stop_token_ids": [ref[index]], "max_tokens": 16, **GREEDY}
    stopped = submit(engine, "a", pre, **stop)
    held = submit(engine, "b", pre, min_tokens=index + 2, **stop)
    final = stopped.wait_done()
    assert stopped.token_ids == ref[: index + 1]
    assert (final.finish_reason, final.stop_reason) == ("stop", ref[index])
    held.wait_done()
    assert held.token_ids[:index] == ref[:index]
    assert ref[index] not in held.token_ids[: index + 2]           # suppressed while below min_tokens
    assert len(held.token_ids) > index + 2


def test_ignore_eos(make_engine, pre, submit):
    engine = make_engine(num_slots=1)
    final = submit(engine, "x", _with_first(pre, EOS), max_tokens=5, ignore_eos=True, **GREEDY).wait_done()
    assert (final.finish_reason, final.completion_tokens) == ("length", 5)


def test_stop_string_in_the_engine(tiny, make_engine, pre, ref, submit):
    text = tiny.tokenizer.decode(ref, skip_special_tokens=True)
    stop = text[len(text) // 2: len(text) // 2 + 3]
    engine = make_engine(num_slots=1)
    sink = submit(engine, "s", pre, stop=[stop], max_tokens=16, **GREEDY)
    final = sink.wait_done()
    assert (final.finish_reason, final.stop_reason) == ("stop", stop)
    assert "".join(e.text for e in sink.events) == text[: text.find(stop)]


def test_abort_frees_the_slot_within_one_step(tiny, make_engine, pre, ref, submit):
    engine = make_engine(num_slots=1)
    long = submit(engine, "long", pre, max_tokens=400, ignore_eos=True, **GREEDY)
    waiting = submit(engine, "next", pre, max_tokens=16, **GREEDY)
    long.wait_tokens(4)
    assert engine.stats().queued == 1
    assert engine.abort("long")
    seen = len(long.token_ids)                 # at most the step in flight can still add one
    final = long.wait_done()
    assert final.finish_reason == "abort" and len(long.token_ids) <= seen + 1
    waiting.wait_done()
    assert waiting.token_ids == ref
    assert not engine.abort("long") and not engine.abort("never-submitted")


def test_abort_a_waiting_request(make_engine, pre, submit):
    engine = make_engine(num_slots=1)
    running = submit(engine, "run", pre, max_tokens=300, ignore_eos=True, **GREEDY)
    queued = submit(engine, "queued", pre, max_tokens=5, **GREEDY)
    running.wait_tokens(2)
    assert engine.abort("queued")
    assert queued.wait_done().finish_reason == "abort"
    assert len(queued.token_ids) == 1          # only the first token (from prefill) was ever out
    engine.abort("run")
    running.wait_done()


def test_engine_full_when_the_queue_is_at_its_bound(make_engine, pre, submit):
    engine = make_engine(num_slots=1, max_queued=1, kv_cache_bytes=8 << 20)   # the pool is not the bound here
    first = submit(engine, "a", pre, max_tokens=300, ignore_eos=True, **GREEDY)
    submit(engine, "b", pre, max_tokens=300, ignore_eos=True, **GREEDY)
    with pytest.raises(EngineFull) as err:
        submit(engine, "c", pre, max_tokens=4, **GREEDY)
    assert err.value.status == 429
    engine.abort("a")
    first.wait_done()
    submit(engine, "c", pre, max_tokens=4, **GREEDY).wait_done()


def test_context_length_admission(make_engine, pre, submit):
    max_len = pre.prompt_len + 6
    engine = make_engine(num_slots=1, max_model_len=max_len)
    with pytest.raises(ContextTooLong):
        submit(engine, "over", pre, max_tokens=7, **GREEDY)
    exact = submit(engine, "exact", pre, max_tokens=6, ignore_eos=True, **GREEDY).wait_done()
    rest = submit(engine, "rest", pre, ignore_eos=True, **GREEDY).wait_done()   # max_tokens=None
    assert exact.completion_tokens == rest.completion_tokens == 6 and rest.finish_reason == "length"


def test_bad_submissions(make_engine, pre):
    engine = make_engine(num_slots=1)
    params = DecodeParams(max_tokens=200, ignore_eos=True, **GREEDY)
    engine.submit("dup", pre.kv, pre.prompt_len, 0, pre.first_token, params)
    for kwargs in ({"request_id": "dup"}, {"kv": pre.kv[:, :, :, :-1]}, {"kv": pre.kv.double()},
                   {"first_token": 10**7}, {"prompt_len": pre.prompt_len + 1}):
        args = {"request_id": "new", "kv": pre.kv, "prompt_len": pre.prompt_len, "rope_delta": 0,
                "first_token": pre.first_token, "params": params, **kwargs}
        with pytest.raises(InvalidRequest):
            engine.submit(**args)


class _FailingEmbed:
    """The tiny LanguageModel, except that embedding decode tokens raises while `failing` is set."""

    def __init__(self, lm) -> None:
        self._lm, self.failing = lm, False

    def __getattr__(self, name):
        return getattr(self._lm, name)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.failing:
            raise RuntimeError("injected step failure")
        return self._lm.embed(token_ids)


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(tiny, pre, ref, submit):
    lm = _FailingEmbed(tiny.lm)
    lm.failing = True
    with DecodeEngine(lm, tiny.tokenizer, num_slots=2, max_model_len=256) as engine:
        failed = submit(engine, "f", pre, max_tokens=8, **GREEDY).wait_done()
        assert failed.finish_reason == "error" and "RuntimeError" in failed.error
        lm.failing = False
        sink = submit(engine, "ok", pre, max_tokens=16, **GREEDY)
        sink.wait_done()
        assert sink.token_ids == ref


def test_close_aborts_pending_requests(tiny, pre, submit):
    engine = DecodeEngine(tiny.lm, tiny.tokenizer, num_slots=1, max_model_len=256, kv_cache_bytes=8 << 20)
    sinks = [submit(engine, f"c{i}", pre, max_tokens=200, ignore_eos=True, **GREEDY) for i in range(2)]
    sinks[0].wait_tokens(2)
    engine.close()
    assert [s.wait_done(5).finish_reason for s in sinks] == ["abort", "abort"]
    with pytest.raises(EngineClosed):
        submit(engine, "late", pre, max_tokens=2)


def test_a_step_that_fails_for_one_request_fails_that_request_alone(tiny, pre, ref, submit, monkeypatch):
    """The step is run again row by row: the row that fails alone ends with an error, every other row's tokens
    are exactly Hugging Face's, with no gap (FAKE: EPD_FAKE_DECODE_POISON makes any step holding a request
    whose id names it raise, the way a real per-request fault would)."""
    monkeypatch.setenv("EPD_FAKE_DECODE_POISON", "poison")
    with DecodeEngine(tiny.lm, tiny.tokenizer, num_slots=4, max_model_len=256) as engine:
        sinks = {name: submit(engine, name, pre, max_tokens=16, **GREEDY) for name in ("a", "poison-b", "c", "d")}
        finals = {name: sink.wait_done() for name, sink in sinks.items()}
        assert finals["poison-b"].finish_reason == "error" and "RuntimeError" in finals["poison-b"].error
        assert sinks["poison-b"].token_ids == ref[:1]   # its first token (prefill's), then the failed step
        assert {name: sinks[name].token_ids for name in ("a", "c", "d")} == {"a": ref, "c": ref, "d": ref}
        assert [finals[name].finish_reason for name in ("a", "c", "d")] == ["length"] * 3
        kv = engine.stats().kv
        assert (kv.used_blocks, kv.reserved_blocks) == (0, 0)
