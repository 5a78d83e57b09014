"""Decode faults under streaming load, with real processes: `epd serve` with two decode instances.

A decode instance killed with SIGKILL while 16 greedy streams run cuts none of them: each goes on on the other
instance (re-prefilled with the tokens it has: coordinator/pipeline.py) with exactly the text of an undisturbed
run.  One poisoned request among 16 (FAKE: EPD_FAKE_DECODE_POISON, services/decode/engine.py) fails alone.
The scenario is benchmarks/decode_faults.py's, whose figures docs/faults.md shows.
"""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.decode_faults import measure, start


@pytest.fixture(scope="module")
def two_decodes(demo_model_path):
    cluster = start(16)
    yield cluster
    cluster.stop()


def test_a_killed_decode_cuts_no_stream_and_a_poisoned_request_fails_alone(two_decodes):
    result = asyncio.run(measure(two_decodes, streams=16, max_tokens=64, kill_after=8))
    assert result["undisturbed_cut"] == 0, result
    assert (result["killed_cut"], result["killed_differ"]) == (0, 0), result
    assert result["resumed"] >= 1, result          # the killed instance held streams, and they went on
    assert (result["poisoned_failed"], result["poisoned_others_differ"]) == (1, 0), result
