"""Helpers for the connector tests: sample tensors, a digest, child processes, a real redis-server."""

from __future__ import annotations

import hashlib
import json
import os
import queue
import subprocess
import sys
import threading

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def sample_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Several dtypes and shapes, including a scalar, an empty and a non-contiguous tensor."""
    g = torch.Generator().manual_seed(seed)
    return {
        "emb": torch.randn(7, 33, generator=g),
        "bf16": torch.randn(3, 5, 2, generator=g).to(torch.bfloat16),
        "half": torch.randn(11, generator=g).to(torch.float16),
        "ids": torch.randint(-(2**40), 2**40, (13,), generator=g, dtype=torch.int64),
        "grid": torch.tensor([[1, 16, 16]], dtype=torch.int64),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "mask": torch.rand(9, generator=g) > 0.5,
        "strided": torch.randn(6, 8, generator=g).t(),
    }


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """Names, dtypes, shapes and exact bytes of a group of tensors."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype, name
        assert got[name].shape == t.shape, name
        assert torch.equal(got[name], t), name


CHILD_PRELUDE = f"""
import json, sys, time
sys.path.insert(0, {ROOT!r})
from services.connectors import StoreConfig, create_store
from tests.services.connectors.helpers import digest, sample_tensors
"""


def child_env() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))   # keep carried wheels (gpu_check)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def run_child(body: str, *args: str, timeout: float = 60.0) -> str:
    """Run `body` in a fresh interpreter (after CHILD_PRELUDE); return its stdout, fail on error."""
    done = subprocess.run([sys.executable, "-c", CHILD_PRELUDE + body, *args], capture_output=True, text=True,
                          timeout=timeout, env=child_env(), cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def start_child(body: str, *args: str) -> subprocess.Popen:
    """A child with pipes; its stdout lines are collected by a thread (see read_json_line)."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD_PRELUDE + body, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
                            cwd=ROOT)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout] + [lines.put("")],
                     daemon=True).start()
    proc.lines = lines  # type: ignore[attr-defined]
    return proc


def read_json_line(proc: subprocess.Popen, timeout: float = 60.0) -> dict:
    """The child's next stdout line as JSON; the deadline guards against a hung child."""
    try:
        line = proc.lines.get(timeout=timeout)  # type: ignore[attr-defined]
    except queue.Empty:
        proc.kill()
        raise AssertionError("child printed nothing before the deadline") from None
    if not line:
        proc.wait(timeout=10)
        raise AssertionError(f"child exited: {proc.stderr.read()[-3000:]}")
    return json.loads(line)


def handle_arg(handle: dict) -> str:
    return json.dumps(handle)
