"""Text that cannot fit the context is refused before it is all tokenized."""

from __future__ import annotations

import time

import pytest

from services.protocol.errors import InvalidRequest
from services.render.text_bound import check_text_fits, longest_token_bytes, message_texts, needs_count


def _counting(calls: list[int]):
    def count(text: str) -> int:
        calls.append(len(text))
        return len(text.split())
    return count


def test_short_text_is_not_looked_at():
    calls: list[int] = []
    check_text_fits(["hello world"], 8192, 16, _counting(calls))
    assert calls == []


@pytest.mark.parametrize("texts", [[], ["", ""], ["a" * 400], ["a" * 399, ""], ["a" * 401], ["a" * 200, "b" * 199],
                                   ["a" * 200, "b" * 200], ["a" * 100, "", "b" * 100, "c" * 198]])
def test_needs_count_says_exactly_when_the_check_would_tokenize(texts):
    """render skips its tokenizer thread when `needs_count` is False: it must be False exactly when
    `check_text_fits` decides without counting (max_model_len 100: 400 characters, newlines between texts)."""
    calls: list[int] = []
    check_text_fits(texts, 100, 1_000_000, _counting(calls))
    assert needs_count(texts, 100) == bool(calls)


def test_a_dense_prefix_refuses_at_once_tokenizing_only_the_prefix():
    calls: list[int] = []
    with pytest.raises(InvalidRequest, match="maximum context length is 100 tokens") as caught:
        check_text_fits(["a " * 1_000_000], 100, 16, _counting(calls))
    assert caught.value.code == "context_length_exceeded"
    assert calls == [400]  # 4 bytes per context token, never the 2 MB


def test_more_bytes_than_the_longest_tokens_can_cover_is_refused():
    calls: list[int] = []
    with pytest.raises(InvalidRequest):
        check_text_fits(["x" * 20_000], 100, 16, _counting(calls))  # one "word": few tokens in the prefix
    check_text_fits(["x" * 3_000], 100, 16, _counting(calls))  # could still fit: left to the exact check


def test_on_the_real_tokenizer_a_20_mb_message_is_refused_in_well_under_a_second(demo_model_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(demo_model_path))
    longest = longest_token_bytes(tokenizer.get_vocab())
    assert 16 <= longest <= 1024
    started = time.perf_counter()
    for text in ("a " * 10_000_000, "x" * 20_000_000):
        with pytest.raises(InvalidRequest):
            check_text_fits([text], 8192, longest, lambda t: len(tokenizer.encode(t, add_special_tokens=False)))
    assert time.perf_counter() - started < 2.0


def test_message_texts():
    messages = [{"role": "user", "content": "a"},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "b"}]}]
    assert message_texts(messages) == ["a", "b"]
