"""Role CPU policy: threads, OpenMP wait policy and niceness, applied in a real child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from services.config import ConfigError, EpdConfig
from services.role_cpu import role_values

PROBE = """
import json, os, sys
from services.config import EpdConfig
from services.role_cpu import apply
config = EpdConfig(role_threads=sys.argv[1], omp_wait_policy=sys.argv[2], role_nice=sys.argv[3])
before = os.nice(0)
summary = apply(config, sys.argv[4])
import torch
print(json.dumps({"threads": torch.get_num_threads(), "nice": os.nice(0) - before, "summary": summary,
                  "wait": os.environ.get("OMP_WAIT_POLICY"), "spin": os.environ.get("GOMP_SPINCOUNT")}))
"""


def _probe(threads: str, wait: str, nice: str, role: str, serve_child: bool = False) -> dict:
    skip = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "EPD_SERVE_CHILD")
    env = {k: v for k, v in os.environ.items() if k not in skip} | ({"EPD_SERVE_CHILD": "1"} if serve_child else {})
    out = subprocess.run([sys.executable, "-c", PROBE, threads, wait, nice, role], capture_output=True, text=True,
                         timeout=120, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _raised(by: int) -> int:
    """What `os.nice(by)` adds here: the kernel caps niceness at 19 (a suite run under `nice -n 15`)."""
    return min(by, 19 - os.nice(0))


def test_per_role_values_reach_torch_the_environment_and_the_scheduler():
    prefill = _probe("prefill=1,decode=2", "passive", "encode=5,prefill=3", "prefill")
    assert (prefill["threads"], prefill["nice"], prefill["wait"], prefill["spin"]) == (1, _raised(3), "PASSIVE", "0")
    decode = _probe("prefill=1,decode=2", "", "encode=5,prefill=3", "decode")
    assert (decode["threads"], decode["nice"], decode["wait"]) == (2, 0, None)
    assert decode["summary"] == "decode cpu policy: threads=2"


def test_auto_niceness_applies_only_under_epd_serve():
    assert _probe("", "", "auto", "prefill", serve_child=True)["nice"] == _raised(5)
    assert _probe("", "", "auto", "decode", serve_child=True)["nice"] == 0
    assert _probe("", "", "auto", "prefill")["nice"] == 0


def test_role_maps_parse_and_bad_ones_are_refused():
    assert role_values("", "decode") is None and role_values("3", "decode") == 3
    assert role_values("decode=2,prefill=1", "prefill") == 1 and role_values("decode=2", "encode") is None
    for bad in ({"role_threads": "decoder=2"}, {"role_nice": "prefill=high"}, {"omp_wait_policy": "spin"}):
        with pytest.raises(ConfigError):
            EpdConfig(**bad)
