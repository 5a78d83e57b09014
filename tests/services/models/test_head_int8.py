"""The int8 copy of the LM head (services/models/head_int8.py Int8Stage): built a chunk of panels at a time in
buffers reused by every chunk (no fresh pages per op), and the same bytes whatever the chunk."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from services.kernels import loader
from services.models import head_int8

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
pytestmark = pytest.mark.skipif(not loader.expected("head_int8"),
                                reason="this CPU has no AVX512-VNNI: the int8 kernel is not built")

BUILD = """
import resource, sys, torch
from services.models import head_int8
torch.set_num_threads(1)
torch.manual_seed(0)
panels = torch.randn(1024, 1024, 16) * 0.05          # a 16384 x 1024 head, 64 MB of float32
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
stage = head_int8.Int8Stage(panels, 16384)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults() -> int:
    out = subprocess.run([sys.executable, "-c", BUILD], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


def test_building_the_copy_faults_in_little_more_than_the_copy_itself():
    """Its own pages and the three 1 MB buffers; new 64 MB temporaries per op took ~50x the copy's pages here."""
    copy_pages = (1024 * 256 * 16 * 4 + 3 * 16384 * 8 + 16384 * 4) // 4096   # weights, scale, ew, nw, colsum
    faults = _faults()
    assert faults < 1.5 * copy_pages, (faults, copy_pages)


def test_the_copy_is_the_same_bytes_whatever_the_chunk(monkeypatch):
    torch.manual_seed(1)
    panels = torch.randn(37, 72, 16) * 0.05                 # 592 columns (an odd number of panels), K = 72
    default = head_int8.Int8Stage(panels, 590)
    monkeypatch.setattr(head_int8, "_CHUNK_BYTES", 1)        # one panel per chunk
    one = head_int8.Int8Stage(panels, 590)
    for name in ("weights", "colsum", "scale", "ew", "nw", "mean_bound"):
        assert torch.equal(getattr(default, name), getattr(one, name)), name
    assert default.w_max == one.w_max
