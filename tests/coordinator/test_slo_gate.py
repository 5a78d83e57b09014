"""The SLO gate's rules (coordinator/slo_gate.py): admit while the predicted first token meets the TTFT target and
the streams decoding meet the TPOT target."""

from __future__ import annotations

import time

import pytest

from coordinator.slo_gate import MIN_TOKENS, SloGate


def test_admits_until_measured_then_refuses_what_would_miss_the_target():
    gate = SloGate(slo_s=0.05)
    assert gate.refusal() is None                  # nothing measured yet
    gate.admitted(1)
    gate.admitted(2)                               # found one waiting
    assert gate.refusal() is None                  # still nothing measured: admitted
    time.sleep(0.03)
    gate.first_token(1)                            # alone: ~30 ms
    assert 0.03 <= (gate.alone_s or 0) < 0.5 and gate.waiting == 1
    time.sleep(0.03)
    gate.first_token(2)                            # 30 ms after the first while it waited: the drain interval
    assert gate.interval_s is not None and 0.03 <= gate.interval_s < 0.5 and gate.waiting == 0
    assert gate.refusal() is None                  # nothing waits: always admitted
    gate.admitted(3)
    refused = gate.refusal()                       # predicted ~60 ms > 50 ms
    assert refused is not None and refused.status == 429 and refused.code == "ttft_slo"
    assert refused.retry_after_s == 1.0
    gate.ended(3)                                  # failed before its first token: no longer waits
    assert gate.waiting == 0 and gate.refusal() is None


def test_a_generous_target_admits_a_queue_and_retry_after_grows_with_it():
    gate = SloGate(slo_s=1.0)
    gate.alone_s, gate.interval_s = 0.2, 0.3
    for key in range(2):
        gate.admitted(key)
    assert gate.refusal() is None                  # 0.2 + 2 * 0.3 = 0.8 s: within the target
    gate.admitted(2)
    refused = gate.refusal()                       # 0.2 + 3 * 0.3 = 1.1 s
    assert refused is not None and refused.retry_after_s == 1.0
    for key in range(3, 20):
        gate.admitted(key)
    refused = gate.refusal()                       # 0.2 + 20 * 0.3 = 6.2 s: come back in 6 s
    assert refused is not None and refused.retry_after_s == 6.0


def test_while_the_streams_decoding_are_past_the_tpot_target_new_requests_wait_outside():
    gate = SloGate(tpot_slo_s=0.05)                # no TTFT target: only the TPOT rule
    gate.admitted(1)
    gate.first_token(1)
    first = gate._streams[1][0]
    assert gate.refusal() is None                  # decoding, nothing measured yet
    gate.tokens(1, MIN_TOKENS - 1)
    gate._streams[1][1] = first + 1.0              # slow, but too few tokens to count yet
    assert gate.tpot_s is None and gate.refusal() is None
    gate.tokens(1, 1)
    gate._streams[1][1] = first + MIN_TOKENS * 0.03   # 30 ms per token over its life: within 50 ms
    assert gate.tpot_s == pytest.approx(0.03) and gate.refusal() is None
    gate.admitted(2)
    gate.first_token(2)
    gate.tokens(2, 10)
    gate._streams[2][1] = gate._streams[2][0] + 10 * 0.1   # a second stream at 100 ms a token: mean 65 ms
    assert gate.tpot_s == pytest.approx(0.065)
    refused = gate.refusal()
    assert refused is not None and refused.status == 429 and refused.code == "tpot_slo"
    assert refused.retry_after_s == 1.0 and "(--tpot-slo-ms)" in refused.message
    assert "the 2 streams decoding get a token every 65 ms" in refused.message
    gate.tokens(3, 3)                              # a request the gate never saw decode: nothing learned
    gate.tokens(2, 0)                              # an empty delta (a finish alone): nothing learned
    assert gate._streams[2][2] == 10 and 3 not in gate._streams
    gate.ended(2)                                  # the slow one ended: the other is within the target
    assert gate.tpot_s == pytest.approx(0.03) and gate.refusal() is None
    gate.ended(1)                                  # nothing decodes now: admitted
    assert gate.tpot_s is None and gate.refusal() is None
    gate.admitted(4)                               # a request waiting: with no TTFT target it is no reason
    gate.admitted(5)
    assert gate.refusal() is None


def test_one_long_pause_in_a_stream_is_absorbed_by_its_mean():
    # a prompt's prefill beside a stream pauses it once (~300 ms here): its TPOT over 20 tokens stays near its
    # pace, as vLLM's benchmark counts it
    gate = SloGate(tpot_slo_s=0.1)
    gate.admitted(1)
    gate.first_token(1)
    gate.tokens(1, 20)
    gate._streams[1][1] = gate._streams[1][0] + 19 * 0.03 + 0.3
    assert gate.tpot_s == pytest.approx(0.0435) and gate.refusal() is None


def test_without_a_tpot_target_slow_streams_are_no_reason():
    gate = SloGate(slo_s=10.0)
    gate.admitted(1)
    gate.first_token(1)
    gate.tokens(1, MIN_TOKENS)
    gate._streams[1][1] = gate._streams[1][0] + MIN_TOKENS * 5.0   # 5 s a token
    assert gate.tpot_s == pytest.approx(5.0) and gate.refusal() is None


def test_a_young_streams_pauses_are_projected_to_its_end_at_the_pace_of_all_streams():
    # A stream 8 tokens old that met two prefill pauses reads 100 ms a token so far; what it has still to send (39
    # of its 47 after the first) comes at the pace of all the streams (2.0 s over 48 tokens), so it ends near 52 ms:
    # the SLO it will be counted against is met, and the request arriving now is admitted.
    gate = SloGate(tpot_slo_s=0.05)
    for key, tokens, span in ((1, 40, 1.2), (2, 8, 0.8)):
        gate.admitted(key)
        gate.first_token(key, 47)
        gate.tokens(key, tokens)
        gate._streams[key][1] = gate._streams[key][0] + span
    pace = 2.0 / 48
    old = (1.2 + 7 * pace) / 47
    young = (0.8 + 39 * pace) / 47
    assert gate.tpot_s == pytest.approx((old + young) / 2) and gate.refusal() is None
    assert young == pytest.approx(0.0516, abs=1e-4)
    gate.ended(1)                                  # alone, the young one's pace is its own: 100 ms, refused
    assert gate.tpot_s == pytest.approx(0.1) and gate.refusal() is not None
    gate.admitted(3)
    gate.first_token(3)                            # max_tokens not told: no further than its tokens so far
    gate.tokens(3, MIN_TOKENS)
    gate._streams[3][1] = gate._streams[3][0] + MIN_TOKENS * 0.02
    pace = (0.8 + MIN_TOKENS * 0.02) / (8 + MIN_TOKENS)   # the young one's rest at both streams' pace now
    assert gate.tpot_s == pytest.approx(((0.8 + 39 * pace) / 47 + 0.02) / 2)


def test_streams_past_the_target_at_their_pace_are_refused_whatever_is_left():
    gate = SloGate(tpot_slo_s=0.1)
    for key in (1, 2):
        gate.admitted(key)
        gate.first_token(key, 47)
        gate.tokens(key, 10)
        gate._streams[key][1] = gate._streams[key][0] + 10 * 0.12   # 120 ms a token, all along
    assert gate.tpot_s == pytest.approx(0.12)
    refused = gate.refusal()
    assert refused is not None and refused.code == "tpot_slo" and "every 120 ms" in refused.message


def test_the_pipeline_tells_the_gate_the_tokens_an_answer_may_send_after_its_first():
    from coordinator.context import RequestContext
    from coordinator.pipeline import expected_after_first
    from services.rpc.v1 import epd_pb2 as pb

    ctx = RequestContext(request_id="r", deadline=time.monotonic() + 10)
    assert expected_after_first(ctx) is None                  # max_tokens not set
    ctx.sampling = pb.SamplingParams(max_tokens=48)
    assert expected_after_first(ctx) == 47
