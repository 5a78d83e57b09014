"""The output judge (services/decode/judge.py) is the one rule decode's engine applies to every token.

Each case runs the real DecodeEngine on a prefilled prompt with a chosen first token and compares its first event
with what an `OutputJudge` built from the same params, EOS ids, token budget and tokenizer says of that token:
text, finish and stop reason, count.  A resumed request (services/decode/request.py `replay`) relies on it."""

from __future__ import annotations

import dataclasses

import pytest

from services.decode.detokenizer import IncrementalDetokenizer, decode_function
from services.decode.judge import OutputJudge, token_budget
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


def _judged(tiny, token: int, prompt_len: int, params: DecodeParams) -> tuple:
    detokenizer = IncrementalDetokenizer(tiny.tokenizer, decode=decode_function(tiny.tokenizer,
                                                                               params.skip_special_tokens))
    budget = token_budget(prompt_len, params, MAX_MODEL_LEN)
    assert budget is not None
    text, finish, reason = OutputJudge(params, tiny.lm.eos_token_ids, budget, detokenizer).judge(token, 1)
    return [token], text, finish, reason, 1


def test_the_engine_judges_a_token_as_the_output_judge_does(tiny, make_engine, submit, story):
    engine = make_engine(num_slots=2)
    for i, (name, token, params) in enumerate(_cases(tiny, story)):
        sink = submit(engine, f"r{i}", dataclasses.replace(story, first_token=token), temperature=0.0, **params)
        sink.wait_tokens(1)
        decoded = sink.events[0]
        judged = _judged(tiny, token, story.prompt_len, DecodeParams(temperature=0.0, **params))
        assert judged == (decoded.token_ids, decoded.text, decoded.finish_reason, decoded.stop_reason,
                          decoded.completion_tokens), name
        engine.abort(f"r{i}")
        sink.wait_done()


def test_the_token_budget():
    assert token_budget(10, DecodeParams(max_tokens=MAX_MODEL_LEN), MAX_MODEL_LEN) is None
    assert token_budget(MAX_MODEL_LEN, DecodeParams(), MAX_MODEL_LEN) is None
    assert token_budget(10, DecodeParams(), MAX_MODEL_LEN) == MAX_MODEL_LEN - 10
    assert token_budget(10, DecodeParams(max_tokens=7), MAX_MODEL_LEN) == 7
