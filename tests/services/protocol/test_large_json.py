"""parse_json_large equals parse_json (values, key order, errors) and lifts only long plain strings."""

from __future__ import annotations

import base64
import binascii
import json
import os

import pytest

from services.protocol import large_json
from services.protocol.b64 import b64decode_strict, b64encode_text
from services.protocol.errors import InvalidRequest
from services.protocol.large_json import parse_json_large
from services.protocol.parsing import parse_json

LONG = "A" * (large_json.LONG_STRING + 5)
PIECE = 256 * 1024  # long enough to take large_json's path for long strings
B64 = base64.b64encode(os.urandom(3 * PIECE + 7)).decode()


@pytest.mark.parametrize("doc", [
    {"token_ids": list(range(300)), "features": {"kwargs_data": {"image": [B64, B64[:70000] + "==", "short"]}}},
    {LONG: [1, {LONG + "k": LONG}], "x": 'q"\\"', "y": LONG + "\\n"},          # keys; escapes nearby
    [LONG, LONG, {"a": LONG}],
    {"text": "é" + LONG, "ctl": LONG + "\t"},                                     # not plain: parsed as is
])
def test_same_result_as_parse_json(doc):
    raw = json.dumps(doc, ensure_ascii=False).encode()
    got = parse_json_large(raw)
    assert got == parse_json(raw)
    assert json.dumps(got) == json.dumps(parse_json(raw))  # key order too


def test_duplicate_keys_as_json_keeps_them():
    raw = b'{"k": "' + LONG.encode() + b'", "' + LONG.encode() + b'": 1, "k": 2, "' + LONG.encode() + b'": 3}'
    assert list(parse_json_large(raw).items()) == list(parse_json(raw).items()) == [("k", 2), (LONG, 3)]


def test_long_plain_strings_are_lifted_out_of_the_parse(monkeypatch):
    raw = json.dumps({"a": B64, "b": "\\" + LONG, "c": LONG}).encode()
    spans = large_json._long_plain_strings(raw)
    assert [raw[s + 1:e].decode() for s, e in spans] == [B64, LONG]   # "b" holds an escape: left in
    seen = []
    monkeypatch.setattr(large_json, "parse_json", lambda body: seen.append(len(body)) or parse_json(body))
    assert parse_json_large(raw)["a"] == B64
    placeholder = len("\\u0000epd-") + 16 + len("-0")  # a JSON escape, the parse's nonce, the index
    assert seen == [len(raw) - len(B64) - len(LONG) + 2 * placeholder], seen  # only "b" was parsed long


@pytest.mark.parametrize("raw", [
    b'{"a": "' + LONG.encode() + b'", }',        # malformed after a long string
    b'{"a": "' + LONG.encode(),                  # unterminated
    b'{"a": "' + LONG.encode() + b'"} x',        # trailing data
    b'{"a": NaN, "b": "' + LONG.encode() + b'"}',
    b'{"a": "' + LONG.encode() + b'\x01"}',                       # a raw control byte inside a long string
    b'{"a": "' + LONG.encode() + b'", "b": "\\ud800"}',            # a lone surrogate beside one
])
def test_errors_are_parse_jsons_own(raw):
    with pytest.raises(InvalidRequest) as expected:
        parse_json(raw)
    with pytest.raises(InvalidRequest) as got:
        parse_json_large(raw)
    assert got.value.message == expected.value.message


def test_other_encodings_are_left_to_json():
    raw = json.dumps({"a": LONG}).encode("utf-16")
    assert parse_json_large(raw) == {"a": LONG} and large_json._long_plain_strings(raw) == []


def test_b64_is_binascii_exactly():
    data = os.urandom(2 * PIECE + 11)
    text = base64.b64encode(data).decode()
    assert b64encode_text(data) == text and b64encode_text(b"") == "" and b64decode_strict(text) == data
    assert b64decode_strict(text.encode()) == data
    for bad in (text[:-1], text[:PIECE] + "=" + text[PIECE + 1:], text[:5] + "*" + text[6:]):
        with pytest.raises(binascii.Error):
            b64decode_strict(bad)
    with pytest.raises(ValueError):
        b64decode_strict(text[:PIECE + 8] + "é" + text[PIECE + 9:])


@pytest.mark.parametrize("bad", [0x00, 0x1F, 0x7F, 0x80, 0xFF, 0x5C])
@pytest.mark.parametrize("at", [0, 1, PIECE - 1, PIECE, PIECE + 1, -1])
def test_a_long_string_is_plain_only_without_control_non_ascii_or_backslash_bytes(bad, at):
    text = bytearray(b"A" * (PIECE + 300))
    assert large_json._is_plain(bytes(text), 0, len(text))
    text[at] = bad
    assert not large_json._is_plain(bytes(text), 0, len(text))
    assert large_json._is_plain(bytes(text), 0, len(text) - 1) == (at == -1)   # the span's end is its own


def test_every_printable_byte_but_the_backslash_is_plain():
    printable = bytes(c for c in range(0x20, 0x7F) if c != 0x5C)
    text = printable * (large_json.LONG_STRING // len(printable) + 1)
    assert large_json._is_plain(text, 0, len(text))
