"""IncrementalDetokenizer: concatenated deltas equal one full `tokenizer.decode`, exactly."""

from __future__ import annotations

import random

import pytest

from services.generation.detokenizer import IncrementalDetokenizer

TEXTS = ["你好世界", "😀🎉👍🏽", " café ñ — “quotes”", "hello world", "日本語のテキスト", "\n\t  spaces  "]
SPECIAL_IDS = list(range(151643, 151657))
OUT_OF_VOCAB = [151657, 151700, 151935]


@pytest.fixture(scope="module")
def pool(tokenizer) -> list[int]:
    ids = set(range(256))                                     # single bytes: lead and continuation bytes
    for text in TEXTS:
        ids.update(tokenizer.encode(text))
        ids.update(tokenizer.encode(text[1:] + text[:1]))
    ids.update(range(1000, 1100))
    return sorted(ids) + SPECIAL_IDS + OUT_OF_VOCAB


def _stream(tokenizer, ids: list[int], skip: bool) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    deltas = [detok.push(t) for t in ids]
    return deltas, detok.flush()


@pytest.mark.parametrize("skip", [True, False])
def test_random_sequences_match_full_decode(tokenizer, pool, skip):
    rng = random.Random(7)
    for _ in range(400):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 40))]
        deltas, tail = _stream(tokenizer, ids, skip)
        assert "".join(deltas) + tail == tokenizer.decode(ids, skip_special_tokens=skip), ids


def test_characters_split_across_byte_tokens_are_held_back(tokenizer):
    emoji = "😀".encode()                      # 4 bytes, sent as 4 single-byte tokens
    byte_ids = {b: tokenizer.convert_tokens_to_ids(t) for b, t in _byte_tokens(tokenizer).items()}
    ids = tokenizer.encode("ok ") + [byte_ids[b] for b in emoji] + tokenizer.encode(" done")
    deltas, tail = _stream(tokenizer, ids, True)
    assert deltas[2:5] == ["", "", ""]         # nothing while the character is incomplete
    assert deltas[5] == "😀"
    assert "".join(deltas) + tail == "ok 😀 done"


def test_incomplete_character_at_the_end_is_flushed(tokenizer):
    ids = tokenizer.encode("abc") + [tokenizer.convert_tokens_to_ids(_byte_tokens(tokenizer)[0xE4])]
    deltas, tail = _stream(tokenizer, ids, True)
    assert "".join(deltas) == "abc"
    assert tail == "\ufffd" == tokenizer.decode(ids)[-1]


def test_out_of_vocab_and_special_ids(tokenizer):
    ids = [151700] + tokenizer.encode("hi") + [151645, 151935] + tokenizer.encode(" there")
    assert "".join(_stream(tokenizer, ids, True)[0]) == "hi there"
    assert "".join(_stream(tokenizer, ids, False)[0]) == "hi<|im_end|> there"


def test_window_stays_short(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    for token in tokenizer.encode("word " * 500):
        detok.push(token)
        assert len(detok._window) <= 4   # O(new tokens) per step, not O(output)


def _byte_tokens(tokenizer) -> dict[int, str]:
    """byte value -> its single-byte token in the byte-level BPE alphabet."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return bytes_to_unicode()
