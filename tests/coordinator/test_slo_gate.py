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
