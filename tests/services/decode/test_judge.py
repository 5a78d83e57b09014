"""Prefill's judge of the first token (services/decode/judge.py) says what decode's engine says of it.

The coordinator sends prefill's first chunk to the client before decode's own first chunk comes; the two must be
the same chunk.  Each case runs the real DecodeEngine on a prefilled prompt with a chosen first token and compares
its first event with `FirstTokenJudge.first_event` for the same params: text, finish and stop reason, count."""

from __future__ import annotations

import dataclasses

import pytest

from services.decode.judge import FirstTokenJudge, token_budget
from services.decode.params import DecodeParams

MAX_MODEL_LEN = 512   # the make_engine fixture's default (conftest.py)


@pytest.fixture(scope="module")
def story(tiny):
    return tiny.prefill_text(tiny.chat_ids("Tell me a story about a cat."))


def _partial_utf8_token(tokenizer) -> int:
    """A byte-level token whose text alone is not whole UTF-8 (decode holds it back: empty text)."""
    return next(i for i in range(100, 20000) if "\ufffd" in tokenizer.decode([i]))


def _cases(tiny, story):
    eos = tiny.lm.eos_token_ids[0]
    real = story.first_token
    word = tiny.tokenizer.decode([real])
    partial = _partial_utf8_token(tiny.tokenizer)
    return [
        ("plain", real, {"max_tokens": 5}),
        ("max_tokens=1 ends it", real, {"max_tokens": 1}),
        ("EOS ends it, no text", eos, {"max_tokens": 5}),
        ("EOS below min_tokens", eos, {"max_tokens": 5, "min_tokens": 2}),
        ("EOS ignored, special text kept", eos, {"max_tokens": 5, "ignore_eos": True, "skip_special_tokens": False}),
        ("stop token id", real, {"max_tokens": 5, "stop_token_ids": [real]}),
        ("stop token id, its text kept", real, {"max_tokens": 5, "stop_token_ids": [real],
                                                "include_stop_str_in_output": True}),
        ("stop string", real, {"max_tokens": 5, "stop": [word.strip() or word]}),
        ("stop string that may start here: held", real, {"max_tokens": 5, "stop": [word + "zzz"]}),
        ("partial UTF-8: held", partial, {"max_tokens": 5}),
        ("partial UTF-8, last token: flushed", partial, {"max_tokens": 1}),
        ("no max_tokens: the context's room", real, {"max_tokens": None}),
    ]


def test_the_first_chunk_prefill_judges_is_the_one_decode_emits(tiny, make_engine, submit, story):
    judge = FirstTokenJudge(tiny.tokenizer, tiny.lm.eos_token_ids, MAX_MODEL_LEN)
    engine = make_engine(num_slots=2)
    for i, (name, token, params) in enumerate(_cases(tiny, story)):
        sink = submit(engine, f"r{i}", dataclasses.replace(story, first_token=token), temperature=0.0, **params)
        sink.wait_tokens(1)
        decoded = sink.events[0]
        judged = judge.first_event(f"r{i}", token, story.prompt_len, DecodeParams(temperature=0.0, **params))
        assert judged is not None, name
        assert (judged.token_ids, judged.text, judged.finish_reason, judged.stop_reason, judged.completion_tokens) \
            == (decoded.token_ids, decoded.text, decoded.finish_reason, decoded.stop_reason,
                decoded.completion_tokens), name
        engine.abort(f"r{i}")
        sink.wait_done()


def test_prefill_leaves_logprobs_and_refused_budgets_to_decode(tiny, story):
    judge = FirstTokenJudge(tiny.tokenizer, tiny.lm.eos_token_ids, MAX_MODEL_LEN)
    assert judge.first_event("r", story.first_token, story.prompt_len, DecodeParams(logprobs=0)) is None
    too_long = DecodeParams(max_tokens=MAX_MODEL_LEN)
    assert judge.first_event("r", story.first_token, story.prompt_len, too_long) is None
    assert token_budget(MAX_MODEL_LEN, DecodeParams(), MAX_MODEL_LEN) is None
    assert token_budget(10, DecodeParams(), MAX_MODEL_LEN) == MAX_MODEL_LEN - 10
    assert token_budget(10, DecodeParams(max_tokens=7), MAX_MODEL_LEN) == 7
