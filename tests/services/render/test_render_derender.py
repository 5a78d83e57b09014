"""Derender gives exactly the text epd's decode streams for the same tokens, streamed or not.

The reference is decode's own DecodeRequest.accept (incremental detokenizer + stop checks) fed the same
ids; derender learns where the output ended from finish_reason / stop_reason, as a real caller passes
them.  Multi-byte characters split across tokens and stop strings across chunk boundaries included.
"""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from services.decode.request import DecodeRequest
from services.decode.stream import DecodeStream
from services.generation.detokenizer import IncrementalDetokenizer, decode_function
from services.generation.params import DecodeParams
from services.render.api_router import routes
from services.render.output_text import OutputText
from services.render.serving import RenderService

EOS = 151645
TEXT = "Héllo wörld, 你好 🙂🙂 stop here. Ünïcode ends\n<tag> done"
CASES = {
    "plain": {},
    "stop_string": {"stop": ["here."]},
    "stop_inside_multibyte_run": {"stop": ["🙂"]},
    "stop_kept": {"stop": ["你好"], "include_stop_str_in_output": True},
    "stop_after_min_tokens": {"stop": ["l"], "min_tokens": 6},
    "special_tokens_shown": {"skip_special_tokens": False},
}


@pytest.fixture(scope="module")
def service(demo_model_path):
    svc = RenderService(demo_model_path, "epd-demo")
    yield svc
    svc.close()


@pytest.fixture(scope="module")
def client(service):
    with TestClient(Starlette(routes=routes(service))) as test_client:
        yield test_client


def decode_reference(tokenizer, ids, params):
    """What decode streams: (texts per token, tokens accepted, finish_reason, stop_reason)."""
    detok = IncrementalDetokenizer(tokenizer, decode=decode_function(tokenizer, params.skip_special_tokens))
    request = DecodeRequest("ref", None, 1, 0, ids[0], params, len(ids), (EOS,), detok, DecodeStream("ref"))
    texts = []
    for token in ids:
        event = request.accept(token)
        texts.append(event.text)
        if event.finished:
            return texts, request.output_ids, event.finish_reason, event.stop_reason
    raise AssertionError("the reference never finished")


def _ids(tokenizer, eos):
    ids = tokenizer.encode(TEXT)
    return [*ids, EOS] if eos else ids


@pytest.mark.parametrize("eos", [False, True], ids=["length", "eos"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_output_text_equals_decode(service, case, eos):
    params = DecodeParams(**CASES[case])
    texts, accepted, finish, reason = decode_reference(service.tokenizer, _ids(service.tokenizer, eos), params)
    for size in (1, 2, 5, len(accepted)):
        out = OutputText(service.tokenizer, params)
        chunks = [accepted[i:i + size] for i in range(0, len(accepted), size)]
        got = "".join(out.feed(chunk, *((finish, reason) if n == len(chunks) - 1 else (None, None)))
                      for n, chunk in enumerate(chunks))
        assert got == "".join(texts)
        assert (out.finish_reason, out.stop_reason) == (finish, reason)


def _chat_request(case):
    return {"messages": [{"role": "user", "content": "hi"}], **CASES[case]}


@pytest.mark.parametrize("case", sorted(CASES))
def test_chat_derender_over_http_streamed_and_not(client, service, case):
    params = DecodeParams(**CASES[case])
    texts, accepted, finish, reason = decode_reference(service.tokenizer, _ids(service.tokenizer, True), params)
    response = {"request_id": "generate-tokens-abc", "created": 7, "usage": {"prompt_tokens": 3},
                "choices": [{"token_ids": accepted, "finish_reason": finish, "stop_reason": reason}]}
    whole = client.post("/v1/chat/completions/derender", json={
        "generate_response": response, "chat_request": _chat_request(case), "prompt_tokens": 3}).json()
    assert whole["id"] == "chatcmpl-abc" and whole["created"] == 7
    assert whole["choices"][0]["message"]["content"] == "".join(texts)
    assert (whole["choices"][0]["finish_reason"], whole["choices"][0]["stop_reason"]) == (finish, reason)
    assert whole["usage"] == {"prompt_tokens": 3, "completion_tokens": len(accepted), "total_tokens": 3 + len(accepted)}
    state, chunks = None, []
    pieces = [accepted[i:i + 3] for i in range(0, len(accepted), 3)]
    for n, piece in enumerate(pieces):
        last = n == len(pieces) - 1
        chunk = {"request_id": "generate-tokens-abc", "created": 7, "choices": [{
            "token_ids": piece, "finish_reason": finish if last else None, "stop_reason": reason if last else None}]}
        answer = client.post("/v1/chat/completions/derender", json={
            "generate_response": chunk, "chat_request": _chat_request(case), "stream": True,
            "stream_state": state}).json()
        state = answer["stream_state"]
        chunks.extend(answer["chunks"])
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:]) == "".join(texts)
    assert [c["choices"][0]["finish_reason"] for c in chunks[1:]][-1] == finish
    assert {c["id"] for c in chunks} == {"chatcmpl-abc"}


def test_completion_derender(client, service):
    ids = service.tokenizer.encode("Once upon a time")
    responses = [{"request_id": "generate-tokens-p0", "choices": [{"token_ids": ids, "finish_reason": "length"}]},
                 {"request_id": "generate-tokens-p1", "choices": [{"token_ids": ids[:2], "finish_reason": "length"}]}]
    whole = client.post("/v1/completions/derender", json={
        "generate_responses": responses, "prompt_tokens": [[1, 2], 5],
        "completion_request": {"prompt": ["a", "b"]}}).json()
    assert whole["id"] == "cmpl-p0" and whole["object"] == "text_completion"
    assert [c["text"] for c in whole["choices"]] == ["Once upon a time", service.tokenizer.decode(ids[:2])]
    assert whole["usage"]["prompt_tokens"] == 7 and whole["usage"]["completion_tokens"] == len(ids) + 2
    echo = client.post("/v1/completions/derender", json={
        "generate_responses": responses[:1], "prompt_tokens": [ids[:1]],
        "completion_request": {"prompt": "a", "echo": True}}).json()
    assert echo["choices"][0]["text"] == service.tokenizer.decode(ids[:1]) + "Once upon a time"
    state, texts = None, []
    for n, token in enumerate(ids):
        chunk = {"request_id": "generate-tokens-p0", "choices": [{
            "token_ids": [token], "finish_reason": "length" if n == len(ids) - 1 else None}]}
        answer = client.post("/v1/completions/derender", json={
            "generate_responses": [chunk], "prompt_tokens": [4], "stream": True, "stream_state": state}).json()
        state = answer["stream_state"]
        texts.extend(c["choices"][0]["text"] for c in answer["chunks"])
    assert "".join(texts) == "Once upon a time"
    usage = client.post("/v1/completions/derender", json={
        "generate_responses": [{"request_id": "generate-tokens-p0", "choices": []}], "prompt_tokens": [4],
        "stream": True, "stream_state": state}).json()
    assert usage["chunks"][-1]["usage"] == {"prompt_tokens": 4, "completion_tokens": len(ids),
                                            "total_tokens": 4 + len(ids)}


@pytest.mark.parametrize("case", ["plain", "stop_inside_multibyte_run"])
def test_chat_stream_derender_in_vllms_shape(client, service, case):
    # vLLM's DerenderChatStreamRequest: generate_chunk, answered with one `chunk` per call
    params = DecodeParams(**CASES[case])
    texts, accepted, finish, reason = decode_reference(service.tokenizer, _ids(service.tokenizer, True), params)
    state, chunks = None, []
    pieces = [accepted[i:i + 2] for i in range(0, len(accepted), 2)]
    for n, piece in enumerate(pieces):
        last = n == len(pieces) - 1
        chunk = {"request_id": "generate-tokens-chatcmpl-abc", "choices": [{
            "index": 0, "token_ids": piece, "finish_reason": finish if last else None,
            "stop_reason": reason if last else None}]}
        reply = client.post("/v1/chat/completions/derender", json={
            "stream": True, "generate_chunk": chunk, "stream_state": state, "prompt_tokens": 3,
            "chat_request": _chat_request(case)})
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        assert set(answer) == {"chunk", "stream_state"}
        state = answer["stream_state"]
        chunks.append(answer["chunk"])
    usage = client.post("/v1/chat/completions/derender", json={
        "stream": True, "generate_chunk": {"request_id": "generate-tokens-chatcmpl-abc", "choices": [],
                                           "usage": {"prompt_tokens": 3, "completion_tokens": len(accepted)}},
        "stream_state": state, "prompt_tokens": 3}).json()["chunk"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["choices"] and "role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == "".join(texts)
    assert chunks[-1]["choices"][0]["finish_reason"] == finish
    assert {c["id"] for c in chunks} == {"chatcmpl-abc"}  # the render id, not prefixed twice
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(accepted)


def test_completion_stream_derender_in_vllms_shape(client, service):
    ids = service.tokenizer.encode("Once upon a time")
    state, text = None, ""
    for n, token in enumerate(ids):
        chunk = {"request_id": "generate-tokens-cmpl-p0", "choices": [{
            "index": 0, "token_ids": [token], "finish_reason": "length" if n == len(ids) - 1 else None}]}
        answer = client.post("/v1/completions/derender", json={
            "stream": True, "generate_chunk": chunk, "stream_state": state, "prompt_tokens": 4}).json()
        state = answer["stream_state"]
        text += answer["chunk"]["choices"][0]["text"]
    assert text == "Once upon a time" and answer["chunk"]["id"] == "cmpl-p0"


@pytest.mark.parametrize("shape", ["epd", "vllm"])
def test_stream_derender_answers_a_chunk_for_every_token_even_while_its_text_is_held_back(client, service, shape):
    """As vLLM's derender: a generate chunk with tokens gets its choice even while a character split across
    tokens holds the text back (empty text), so a client sees each token when it is generated."""
    ids = service.tokenizer.encode("🫠🫠")
    assert len(ids) == 6   # three byte-level tokens per character on this tokenizer
    state, texts = None, []
    for n, token in enumerate(ids):
        generated = {"request_id": "generate-tokens-cmpl-p0", "choices": [{
            "index": 0, "token_ids": [token], "finish_reason": "length" if n == len(ids) - 1 else None}]}
        asked = {"generate_responses": [generated], "prompt_tokens": [4]} if shape == "epd" else \
            {"generate_chunk": generated, "prompt_tokens": 4}
        answer = client.post("/v1/completions/derender", json={"stream": True, "stream_state": state, **asked}).json()
        state = answer["stream_state"]
        chunks = answer["chunks"] if shape == "epd" else [answer["chunk"]]
        texts.append([c["text"] for chunk in chunks for c in chunk["choices"]])
    assert texts == [[""], [""], ["🫠"], [""], [""], ["🫠"]]


def test_derender_turns_generate_logprobs_into_openai_logprobs(client, service):
    """GenerateLogProbs (ids, vLLM's engine order) -> OpenAI chat / completion logprobs with the token texts."""
    ids = service.tokenizer.encode("Hello world")[:2]
    generated = {"content": [
        {"token_id": ids[0], "logprob": -0.5, "rank": 1, "top_logprobs": [
            {"token_id": ids[0], "logprob": -0.5, "rank": 1}, {"token_id": ids[1], "logprob": -1.5, "rank": 2}]},
        {"token_id": ids[1], "logprob": -3.0, "rank": 3, "top_logprobs": [
            {"token_id": ids[1], "logprob": -3.0, "rank": 3}, {"token_id": ids[0], "logprob": -0.1, "rank": 1}]}]}
    response = {"request_id": "generate-tokens-lp", "choices": [{"token_ids": ids, "finish_reason": "length",
                                                                 "logprobs": generated}]}
    texts = [service.tokenizer.decode([t]) for t in ids]
    chat = client.post("/v1/chat/completions/derender", json={"generate_response": response, "prompt_tokens": 1})
    content = chat.json()["choices"][0]["logprobs"]["content"]
    assert [(c["token"], c["logprob"]) for c in content] == [(texts[0], -0.5), (texts[1], -3.0)]
    assert [[t["token"] for t in c["top_logprobs"]] for c in content] == [texts, [texts[0], texts[1]]]
    done = client.post("/v1/completions/derender", json={"generate_responses": [response], "prompt_tokens": [1]})
    logprobs = done.json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == texts and logprobs["token_logprobs"] == [-0.5, -3.0]
    assert logprobs["top_logprobs"][1] == {texts[1]: -3.0, texts[0]: -0.1}
    assert logprobs["text_offset"] == [0, len(texts[0])]
