"""A request's three time bounds (coordinator/deadlines.py): first token, stall, and an optional total."""

from __future__ import annotations

import math
import time

import pytest

from coordinator.deadlines import Deadlines
from services.config import EpdConfig
from services.protocol.errors import InvalidRequest

CONFIG = EpdConfig(ttft_timeout_s=60.0, stream_idle_timeout_s=30.0, max_request_timeout_s=3600.0)


def test_without_a_header_the_total_is_the_cap_and_the_first_token_bound_applies():
    before = time.monotonic()
    bounds = Deadlines.for_request(CONFIG, None)
    after = time.monotonic()
    assert before + 60.0 <= bounds.first_token <= after + 60.0
    assert before + 3600.0 <= bounds.total <= after + 3600.0 and bounds.idle_s == 30.0


def test_a_client_total_shorter_than_the_first_token_bound_bounds_both():
    bounds = Deadlines.for_request(CONFIG, "2.5")
    assert bounds.first_token == bounds.total and bounds.total - time.monotonic() <= 2.5


def test_a_client_total_is_capped_by_the_server():
    bounds = Deadlines.for_request(CONFIG.with_(max_request_timeout_s=10.0), "1e9")
    assert bounds.total - time.monotonic() <= 10.0 and bounds.first_token == bounds.total


@pytest.mark.parametrize("header", ["0", "-1", "abc", "inf", "nan", ""])
def test_a_bad_header_is_a_400_naming_it(header):
    with pytest.raises(InvalidRequest) as err:
        Deadlines.for_request(CONFIG, header)
    assert (err.value.status, err.value.code) == (400, "invalid_timeout")
    assert "X-Request-Timeout" in err.value.message and math.isfinite(err.value.status)
