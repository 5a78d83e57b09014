"""The redis figure's fallback baseline and the benchmarks' private output folders."""

from __future__ import annotations

import os
import subprocess
import sys

import redis

from benchmarks.common import RESULTS_ENV, ROOT
from benchmarks.resp_baseline import command, raw_resp_seconds


def test_resp_command_encoding():
    assert command(b"GET", b"k") == b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n"


def test_raw_resp_baseline_round_trips_the_value_and_cleans_up(redis_server):
    timings = raw_resp_seconds(redis_server.port, 1 << 20, requests=3)
    assert set(timings) == {"set_s", "get_s"} and all(0 < t < 5 for t in timings.values())
    assert redis.Redis.from_url(redis_server.url).exists("epd-bench-baseline") == 0


def _quick_results_dir(env: dict[str, str]) -> str:
    code = "from benchmarks.common import results_dir; print(results_dir(True))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60, check=True)
    return out.stdout.strip()


def test_quick_results_never_share_a_fixed_folder(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != RESULTS_ENV}
    first, second = _quick_results_dir(env), _quick_results_dir(env)
    assert first != second and os.path.isdir(first) and os.path.isdir(second)
    os.rmdir(first), os.rmdir(second)
    assert _quick_results_dir({**env, RESULTS_ENV: str(tmp_path)}) == str(tmp_path)
