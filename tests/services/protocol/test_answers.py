"""The one answer builder: the same deltas give the generate, chat and completion shapes, whole and streamed."""

from __future__ import annotations

import asyncio
import json

from services.protocol.answers import GenerateAnswer, OpenAIAnswer, OutputDelta
from services.protocol.errors import Unavailable
from services.protocol.generate import StreamOptions
from services.protocol.logprobs import TokenLogprob
from tests.support.sse import parse_sse_data

DELTAS = [OutputDelta([5], "Hel"), OutputDelta([6, 7], "lo"), OutputDelta([8], "!", "stop", 8)]


async def _source(deltas, fail: Exception | None = None):
    for delta in deltas:
        yield delta
    if fail is not None:
        raise fail


def _writes(builder, deltas, fail=None) -> list[bytes]:
    """What the stream hands the server to write, write by write."""
    async def run():
        return [f async for f in builder.sse(_source(deltas, fail))]

    return asyncio.run(run())


def _frames(builder, deltas, fail=None) -> list:
    """Every SSE event, parsed (a write may carry more than one)."""
    return [parse_sse_data(event + b"\n\n") or event + b"\n\n" for write in _writes(builder, deltas, fail)
            for event in write.split(b"\n\n") if event]


def test_a_chat_streams_role_chunk_goes_out_with_its_first_token():
    """One write for both: the client wakes once for the first token, not first for the role chunk."""
    writes = _writes(OpenAIAnswer("chat", "chatcmpl-x", "m", 7), DELTAS)
    first = [parse_sse_data(e + b"\n\n") for e in writes[0].split(b"\n\n") if e]
    assert [e["choices"][0]["delta"] for e in first] == [{"role": "assistant", "content": ""}, {"content": "Hel"}]
    assert len(writes) == len(DELTAS) + 1   # the role chunk rode on the first; [DONE] is its own


def test_chat_collect():
    body = asyncio.run(OpenAIAnswer("chat", "chatcmpl-x", "m", 7, prompt_tokens=3).collect(_source(DELTAS)))
    assert body == {"id": "chatcmpl-x", "object": "chat.completion", "created": 7, "model": "m",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello!"},
                                 "finish_reason": "stop", "logprobs": None, "stop_reason": 8}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}


def test_completion_collect_with_token_ids():
    builder = OpenAIAnswer("completion", "cmpl-x", "m", 7, prompt_tokens=2, prompt_token_ids=[1, 2])
    body = asyncio.run(builder.collect(_source(DELTAS[:2])))
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "Hello"
    assert body["choices"][0]["finish_reason"] == "length"  # ended without a reason: the budget ran out
    assert body["choices"][0]["token_ids"] == [5, 6, 7] and body["prompt_token_ids"] == [1, 2]


def test_chat_stream_role_deltas_finish_usage_done():
    events = _frames(OpenAIAnswer("chat", "chatcmpl-x", "m", 7, prompt_tokens=3, include_usage=True), DELTAS)
    assert events[-1] == b"data: [DONE]\n\n"
    assert [e["choices"][0]["delta"] for e in events[:4]] == \
        [{"role": "assistant", "content": ""}, {"content": "Hel"}, {"content": "lo"}, {"content": "!"}]
    assert [e["choices"][0]["finish_reason"] for e in events[:4]] == [None, None, None, "stop"]
    assert all(e["usage"] is None for e in events[:4])
    assert events[4]["choices"] == [] and events[4]["usage"]["completion_tokens"] == 4


def test_stream_without_include_usage_has_no_usage_key():
    events = _frames(OpenAIAnswer("completion", "cmpl-x", "m", 7), DELTAS)
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["Hel", "lo", "!"]
    assert all("usage" not in e for e in events[:-1])


def test_every_token_gets_a_chunk_while_its_text_is_held_back():
    """vLLM's rule (clients time the first token by the first chunk): a token whose text decode holds back (an
    incomplete character, a possible stop string) still gets its chunk, with empty text; logprob offsets follow
    the tokens reported, not the text."""
    def lp(token_id: int, token: str) -> TokenLogprob:
        return TokenLogprob(token_id, -1.0, 1, token=token)

    held = [OutputDelta([5], "", logprobs=[lp(5, "\ufffd")]), OutputDelta([6], "é", logprobs=[lp(6, "\ufffd")]),
            OutputDelta([7], "", logprobs=[lp(7, " a")]), OutputDelta([], " a", "stop", "x")]
    events = _frames(OpenAIAnswer("completion", "cmpl-x", "m", 7), held)
    choices = [e["choices"][0] for e in events[:-1]]
    assert [(c["text"], c["finish_reason"]) for c in choices] == [("", None), ("é", None), ("", None), (" a", "stop")]
    assert [c["logprobs"]["text_offset"] if c["logprobs"] else None for c in choices] == [[0], [1], [2], None]
    chat = _frames(OpenAIAnswer("chat", "chatcmpl-x", "m", 7), held)
    assert [e["choices"][0]["delta"] for e in chat[:-1]] == [
        {"role": "assistant", "content": ""}, {"content": ""}, {"content": "é"}, {"content": ""}, {"content": " a"}]


def test_a_failure_after_the_first_byte_is_an_in_stream_error():
    events = _frames(OpenAIAnswer("chat", "chatcmpl-x", "m", 7), DELTAS[:1],
                     fail=Unavailable("decode died", code="decode_failed"))
    assert events[-2] == {"error": {"message": "decode died", "type": "service_unavailable",
                                    "code": "decode_failed"}}
    assert events[-1] == b"data: [DONE]\n\n"


def test_generate_collect_and_stream():
    builder = GenerateAnswer("generate-tokens-x", "m", 3, StreamOptions(continuous_usage_stats=True), created=7)
    whole = asyncio.run(builder.collect(_source(DELTAS)))
    assert json.loads(whole.model_dump_json())["choices"] == [
        {"index": 0, "token_ids": [5, 6, 7, 8], "finish_reason": "stop", "logprobs": None, "stop_reason": 8,
         "weight_versions": None}]
    events = _frames(builder, DELTAS)
    assert [e["choices"][0]["token_ids"] for e in events[:3]] == [[5], [6, 7], [8]]
    assert [e["usage"]["completion_tokens"] for e in events[:3]] == [1, 3, 4]  # continuous usage
    assert events[3]["choices"] == [] and events[4] == b"data: [DONE]\n\n"


def test_generate_without_a_finish_is_an_abort():
    whole = asyncio.run(GenerateAnswer("g", "m", 1).collect(_source(DELTAS[:1])))
    assert whole.choices[0].finish_reason == "abort" and whole.usage.completion_tokens == 1


# Text held back (a possible stop-string prefix) comes out later without ids; a logprob record per id.
TEXT_DELTAS = [OutputDelta([5], "Hel", logprobs=[TokenLogprob(5, -0.5, 1, (5, 9), (-0.5, -1.5), "Hel", ("Hel", "x"))]),
               OutputDelta([6], "", logprobs=[TokenLogprob(6, -2.0, 2, (7, 6), (-1.0, -2.0), "l", ("lo", "l"))]),
               OutputDelta([], "lo", "stop", "!")]


def test_generate_text_mode_whole_has_text_and_chat_shaped_logprobs():
    builder = GenerateAnswer("generate-tokens-x", "m", 3, created=7, output_mode="text")
    body = json.loads(asyncio.run(builder.collect(_source(TEXT_DELTAS))).model_dump_json())
    assert body["output_mode"] == "text" and body["usage"]["completion_tokens"] == 2
    [choice] = body["choices"]
    assert {k: v for k, v in choice.items() if k != "logprobs"} == {
        "index": 0, "token_ids": [5, 6], "finish_reason": "stop", "stop_reason": "!", "text": "Hello",
        "weight_versions": None}
    assert choice["logprobs"] == {"content": [
        {"token": "Hel", "logprob": -0.5, "bytes": [72, 101, 108],
         "top_logprobs": [{"token": "Hel", "logprob": -0.5, "bytes": [72, 101, 108]},
                          {"token": "x", "logprob": -1.5, "bytes": [120]}]},
        # vLLM's engine order: the sampled token first, then the rest by rank, n in all
        {"token": "l", "logprob": -2.0, "bytes": [108],
         "top_logprobs": [{"token": "l", "logprob": -2.0, "bytes": [108]},
                          {"token": "lo", "logprob": -1.0, "bytes": [108, 111]}]}]}


def test_generate_text_mode_streams_text_deltas_even_without_ids():
    events = _frames(GenerateAnswer("generate-tokens-x", "m", 3, StreamOptions(), created=7, output_mode="text"),
                     TEXT_DELTAS)
    chunks = events[:3]
    assert [c["choices"][0]["text"] for c in chunks] == ["Hel", "", "lo"]
    assert [c["choices"][0]["token_ids"] for c in chunks] == [[5], [6], []]
    assert [c["output_mode"] for c in events[:4]] == ["text"] * 4
    assert chunks[2]["choices"][0]["finish_reason"] == "stop" and chunks[2]["choices"][0]["logprobs"] is None
    assert events[3]["choices"] == [] and events[3]["usage"]["completion_tokens"] == 2
    assert events[4] == b"data: [DONE]\n\n"
    # tokens mode: the same deltas, no text key, and no event for text alone (held-back text has no ids)
    plain = _frames(GenerateAnswer("generate-tokens-x", "m", 3, StreamOptions(), created=7),
                    [OutputDelta([5], "Hel"), OutputDelta([], "lo"), OutputDelta([], "", "stop")])
    assert [c["choices"][0] for c in plain[:2]] == [
        {"index": 0, "token_ids": [5], "finish_reason": None, "logprobs": None, "stop_reason": None,
         "weight_versions": None},
        {"index": 0, "token_ids": [], "finish_reason": "stop", "logprobs": None, "stop_reason": None,
         "weight_versions": None}]
    assert plain[0]["output_mode"] == "tokens" and len(plain) == 4


def test_generate_tokens_mode_bytes_are_unchanged():
    whole = asyncio.run(GenerateAnswer("generate-tokens-x", "m", 3, created=7).collect(_source(DELTAS)))
    assert whole.model_dump_json() == (
        '{"request_id":"generate-tokens-x","model":"m","created":7,"choices":[{"index":0,"token_ids":[5,6,7,8],'
        '"finish_reason":"stop","logprobs":null,"stop_reason":8,"weight_versions":null}],"usage":{"prompt_tokens":3,'
        '"completion_tokens":4,"total_tokens":7},"kv_transfer_params":null,"ec_transfer_params":null,'
        '"output_mode":"tokens","prompt_token_ids":null,"mm_placeholders":null,"metrics":null,'
        '"prompt_logprobs":null}')
