from __future__ import annotations

import pytest

from services.protocol.errors import InvalidRequest
from services.protocol.generate import GenerateRequest
from services.protocol.parsing import parse_json, parse_model, validate_model


def _message(cls, body) -> str:
    with pytest.raises(InvalidRequest) as caught:
        parse_model(cls, body)
    assert caught.value.status == 400
    return caught.value.message


@pytest.mark.parametrize("body", [b"", b"{", b'{"token_ids": [1],}', b"\xff\xfe\x00", "{'a': 1}"])
def test_malformed_json(body):
    assert _message(GenerateRequest, body).startswith("malformed JSON body: ")


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_json_nan_and_infinity_literals_are_refused(literal):
    body = '{"token_ids": [1], "sampling_params": {"temperature": ' + literal + "}}"
    assert _message(GenerateRequest, body) == f"malformed JSON body: {literal} is not a valid JSON number"


def test_overflowing_float_is_not_finite():
    body = b'{"token_ids": [1], "sampling_params": {"temperature": 1e999}}'
    assert _message(GenerateRequest, body) == "sampling_params.temperature: must be a finite number"


def test_nan_in_an_already_decoded_mapping_is_refused():
    with pytest.raises(InvalidRequest, match="must be a finite number"):
        validate_model(GenerateRequest, {"token_ids": [1], "sampling_params": {"top_p": float("nan")}})


def test_body_must_be_an_object():
    assert _message(GenerateRequest, b"[1, 2]") == "request body must be a JSON object, got list"


def test_deep_json_is_refused_not_crashing():
    assert _message(GenerateRequest, b"[" * 100000 + b"]" * 100000).startswith("malformed JSON body")


def test_messages_name_field_and_rule():
    assert _message(GenerateRequest, b"{}") == "token_ids: field required"
    assert _message(GenerateRequest, b'{"token_ids": [1, -2, true, "3"]}') == (
        "token_ids[1]: must be >= 0; token_ids[2]: must be an integer; token_ids[3]: must be an integer")


def test_many_errors_are_capped():
    body = {"token_ids": [-1] * 9}
    message = _message(GenerateRequest, body)
    assert message.count("must be >= 0") == 5 and message.endswith("(and 4 more)")


def test_parse_accepts_bytes_str_and_mapping():
    text = '{"token_ids": [5]}'
    bodies = (text.encode(), text, {"token_ids": [5]}, bytearray(text.encode()))
    for body in bodies:
        assert parse_model(GenerateRequest, body).token_ids == [5]
    assert parse_json(memoryview(b"[1]")) == [1]


@pytest.mark.parametrize("raw", [b'{"t": "\\ud800"}', '{"t": "\\udfff x"}', bytearray(b'{"t": "\\udbff"}')])
def test_a_lone_surrogate_escape_is_refused(raw):
    with pytest.raises(InvalidRequest, match="lone UTF-16 surrogate"):
        parse_json(raw)


def test_a_surrogate_pair_an_escaped_backslash_and_a_body_without_escapes_parse():
    assert parse_json(b'{"t": "\\ud83d\\ude00"}') == {"t": "\U0001F600"}
    assert parse_json(b'{"t": "a\\\\ud800"}') == {"t": "a\\ud800"}
    assert parse_json(b'{"t": "no escape at all"}') == {"t": "no escape at all"}
