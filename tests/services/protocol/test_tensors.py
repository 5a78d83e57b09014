from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from services.protocol.tensors import (
    RawTensor,
    check_tensor_header,
    tensor_bytes,
    tensor_from_bytes,
    tensor_nbytes,
    to_numpy,
    to_torch,
)
from tests.support.tensors import bfloat16_to_float32, from_torch


def test_numpy_round_trip_every_dtype():
    for name in ("float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "bool"):
        array = (np.arange(6) % 2 == 0) if name == "bool" else np.arange(6).astype(name)
        array = array.reshape(2, 3)
        back = tensor_from_bytes(name, (2, 3), tensor_bytes(array))
        assert back.dtype.name == name and np.array_equal(back, array)


def test_bytes_are_c_contiguous_little_endian():
    array = np.arange(6, dtype=">i4").reshape(2, 3).T  # big-endian and not C-contiguous
    data = tensor_bytes(array)
    assert data == np.ascontiguousarray(array).astype("<i4").tobytes()
    assert data[:4] == b"\x00\x00\x00\x00" and data[4:8] == b"\x03\x00\x00\x00"


def test_bfloat16_raw_tensor():
    # 1.0, -2.0, 0.5 in bfloat16 = top 16 bits of their float32 patterns
    bits = np.array([0x3F80, 0xC000, 0x3F00], dtype="<u2")
    raw = RawTensor("bfloat16", (3,), bits.tobytes())
    assert tensor_nbytes(raw) == 6
    assert np.array_equal(to_numpy(raw), bits)
    assert bfloat16_to_float32(raw).tolist() == [1.0, -2.0, 0.5]


def test_raw_tensor_checks_its_header():
    with pytest.raises(ValueError, match="needs 8 bytes, got 6"):
        RawTensor("bfloat16", (4,), b"\x00" * 6)
    with pytest.raises(ValueError, match="unknown dtype 'complex64'"):
        check_tensor_header("complex64", (1,), 8)
    with pytest.raises(ValueError, match="non-negative"):
        check_tensor_header("uint8", (-1,), 0)


def test_empty_tensor():
    back = tensor_from_bytes("float32", (0, 1176), b"")
    assert back.shape == (0, 1176)


def test_torch_round_trip_including_bfloat16():
    torch = pytest.importorskip("torch")
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16):
        original = (torch.arange(12) % 5).to(dtype).reshape(3, 4)
        wire = from_torch(original)
        back = to_torch(tensor_from_bytes(*_header(wire), tensor_bytes(wire)))
        assert back.dtype == dtype and torch.equal(back, original)
        back.add_(0) if dtype != torch.bool else None  # writable memory


def _header(tensor):
    name = tensor.dtype if isinstance(tensor, RawTensor) else tensor.dtype.name
    return name, tuple(tensor.shape)


def test_protocol_modules_do_not_import_torch():
    modules = ["serialization", "generate", "openai", "openai_responses", "tokenization", "derender",
               "streaming", "parsing"]
    code = ("import sys\n" + "".join(f"import services.protocol.{m}\n" for m in modules)
            + "assert 'torch' not in sys.modules, 'torch imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
