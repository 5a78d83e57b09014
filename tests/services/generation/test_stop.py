"""Stop rules: token stops, stop strings across tokens, hold-back, include_stop_str_in_output."""

from __future__ import annotations

from services.decode.request import DecodeRequest
from services.decode.stream import DecodeStream
from services.generation.detokenizer import IncrementalDetokenizer
from services.generation.params import DecodeParams
from services.generation.stop import StopChecker

EOS = (151645, 151643)


def _request(tokenizer, max_tokens: int = 100, **params) -> DecodeRequest:
    p = DecodeParams(**params)
    return DecodeRequest("r", None, 5, 0, 0, p, max_tokens, EOS,
                         IncrementalDetokenizer(tokenizer, p.skip_special_tokens), DecodeStream("r"))


def _run(request: DecodeRequest, ids: list[int]):
    events = []
    for token in ids:
        events.append(request.accept(token))
        if events[-1].finished:
            break
    return events


def test_token_stops():
    checker = StopChecker(DecodeParams(stop_token_ids=[7], min_tokens=2), EOS, max_tokens=5)
    assert checker.check_token(151645, 1) == (None, None)       # below min_tokens
    assert checker.check_token(151645, 2) == ("stop", None)     # EOS: no stop_reason
    assert checker.check_token(7, 3) == ("stop", 7)
    assert checker.check_token(8, 5) == ("length", None)
    ignoring = StopChecker(DecodeParams(ignore_eos=True), EOS, max_tokens=5)
    assert ignoring.check_token(151645, 1) == (None, None)


def test_stop_string_held_back_then_cut():
    checker = StopChecker(DecodeParams(stop=["STOP here"]), EOS, max_tokens=100)
    assert checker.check_text("abc ST", 1) == ("abc ", None)     # "ST" may start the stop string
    assert checker.check_text("x", 2) == ("STx", None)          # it did not: released
    assert checker.check_text(" STOP h", 3) == (" ", None)
    assert checker.check_text("ere and more", 4) == ("", "STOP here")


def test_hold_back_is_bounded_by_the_longest_stop():
    checker = StopChecker(DecodeParams(stop=["cd", "abcdef"]), EOS, max_tokens=100)
    assert checker.check_text("xxabcde", 1) == ("xxab", "cd")   # a match cuts at once
    checker = StopChecker(DecodeParams(stop=["cX", "abcdef"]), EOS, max_tokens=100)
    assert checker.check_text("xxabcde", 1) == ("xx", None)     # holds "abcde": 5 = len("abcdef") - 1
    assert checker.check_text("Q", 2) == ("abcdeQ", None)
    checker = StopChecker(DecodeParams(stop=["zz", "abcdef"]), EOS, max_tokens=100)
    assert checker.check_text("--abc", 1) == ("--", None)
    assert checker.check_text("dzz", 2) == ("abcd", "zz")       # the earliest match wins


def test_flush_releases_held_text_and_matches_a_completed_stop():
    checker = StopChecker(DecodeParams(stop=["END"]), EOS, max_tokens=100)
    assert checker.check_text("fin E", 1) == ("fin ", None)
    assert checker.flush("N", 2) == ("EN", None)
    checker = StopChecker(DecodeParams(stop=["END"], include_stop_str_in_output=True), EOS, max_tokens=100)
    assert checker.check_text("fin EN", 1) == ("fin ", None)
    assert checker.flush("D!", 2) == ("END", "END")


def test_stop_string_spanning_tokens(tokenizer):
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog")
    for include in (False, True):
        events = _run(_request(tokenizer, stop=["own fox ju"], include_stop_str_in_output=include), ids)
        final = events[-1]
        assert (final.finish_reason, final.stop_reason) == ("stop", "own fox ju")
        text = "".join(e.text for e in events)
        assert text == ("The quick brown fox ju" if include else "The quick br")
        assert tokenizer.decode([t for e in events for t in e.token_ids]).startswith("The quick brown fox ju")


def test_text_streams_in_order_and_complete_without_stops(tokenizer):
    ids = tokenizer.encode("你好世界 😀 and some words")
    events = _run(_request(tokenizer, max_tokens=len(ids), stop=["never appears"]), ids)
    assert events[-1].finish_reason == "length"
    assert "".join(e.text for e in events) == tokenizer.decode(ids)
    assert events[-1].completion_tokens == len(ids)


def test_eos_text_excluded_unless_asked(tokenizer):
    ids = tokenizer.encode("hi") + [151645]
    plain = _run(_request(tokenizer, skip_special_tokens=False), ids)
    assert "".join(e.text for e in plain) == "hi"
    assert plain[-1].token_ids == [151645] and plain[-1].stop_reason is None
    shown = _run(_request(tokenizer, skip_special_tokens=False, include_stop_str_in_output=True), ids)
    assert "".join(e.text for e in shown) == "hi<|im_end|>"


def test_stop_strings_wait_for_min_tokens(tokenizer):
    ids = tokenizer.encode(" a b a b a b")
    events = _run(_request(tokenizer, stop=[" b"], min_tokens=3), ids)
    # " b" at token 2 is below min_tokens and streams; token 3 is " a"; token 4 stops.
    assert events[-1].completion_tokens == 4 and events[-1].stop_reason == " b"
    assert "".join(e.text for e in events) == " a b a"
