from __future__ import annotations

import json

from services.bench.stream import RequestResult, StreamRecorder


def _chunk(content=None, usage=None, reasoning=None):
    delta = {k: v for k, v in (("content", content), ("reasoning_content", reasoning)) if v is not None}
    body = {"choices": [{"index": 0, "delta": delta}] if delta or content == "" else []}
    if usage:
        body["usage"] = usage
    return json.dumps(body)


def _record(events):
    recorder = StreamRecorder(RequestResult(0, start=100.0), est_prompt_tokens=7)
    for at, data in events:
        recorder.on_event(data, at)
    return recorder.finish()


def test_ttft_skips_empty_chunks_and_itl_spans_content_chunks():
    r = _record([(100.01, _chunk("")), (100.05, _chunk(reasoning="hm")), (100.07, _chunk("a")),
                 (100.10, _chunk("b")), (100.11, _chunk(usage={"prompt_tokens": 9, "completion_tokens": 5})),
                 (100.12, "[DONE]")])
    assert r.ok and abs(r.ttft_s - 0.05) < 1e-9 and abs(r.e2el_s - 0.12) < 1e-9
    assert [round(x, 6) for x in r.itl_s] == [0.02, 0.03]
    assert (r.output_tokens, r.prompt_tokens, r.has_usage, r.num_chunks) == (5, 9, True, 3)
    assert abs(r.tpot_s - (0.12 - 0.05) / 4) < 1e-9


def test_without_usage_chunks_are_tokens_and_prompt_is_estimated():
    r = _record([(100.02, _chunk("x")), (100.03, _chunk("y"))])
    assert r.ok and r.output_tokens == 2 and r.prompt_tokens == 7 and not r.has_usage
    assert abs(r.e2el_s - 0.03) < 1e-9  # no [DONE]: the last event ends it


def test_in_stream_errors_and_empty_answers_fail():
    r = _record([(100.02, _chunk("x")), (100.03, json.dumps({"error": {"message": "boom"}}))])
    assert not r.ok and r.error == "stream error: boom"
    assert _record([(100.01, _chunk(""))]).error == "no content received"
    assert _record([(100.01, "{not json")]).error.startswith("unparsable stream event")
    assert RequestResult(0, 0.0, ttft_s=0.1, e2el_s=0.2, output_tokens=1).tpot_s is None
