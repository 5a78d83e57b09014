"""mm_hash equals vLLM's MultiModalHasher, is deterministic across processes, and a uuid is used as is.

The KNOWN values were printed by vLLM 0.32.0's own hasher (`MultiModalHasher.hash_kwargs("blake3",
model_id="epd-demo", image=MediaWithBytes(image, b"\\x89PNG bytes"), ...)`); the interop suite
(tests/interop) checks the hashes of real images against a running vLLM render.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from services.render.hashing import mm_hash

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
KNOWN = "1cca1fd9aa298da6abb049723ec1c62327e1046073e2dd0e7dfb10a3cd3cd645"
KWARGS = {"max_pixels": 1000, "flag": True, "x": [1, 2.5, None, "a"]}
KNOWN_WITH_KWARGS = "c2981dba76d00b296b66aeb666768aad03a51062b5799b0894103ef7ff4b7c7a"


def test_hash_is_vllms() -> None:
    assert mm_hash("image", b"\x89PNG bytes", "epd-demo") == KNOWN


def test_processor_kwargs_are_hashed_as_vllm_does() -> None:
    assert mm_hash("image", b"\x89PNG bytes", "epd-demo", KWARGS) == KNOWN_WITH_KWARGS
    assert mm_hash("image", b"\x89PNG bytes", "epd-demo", {}) == KNOWN  # no overrides: not hashed


@pytest.mark.parametrize("change", [
    {"modality": "video"}, {"media": b"\x89PNG bytez"}, {"model_id": "other-model"},
    {"mm_processor_kwargs": {"max_pixels": 1}},
])
def test_every_input_changes_the_hash(change: dict) -> None:
    base = {"modality": "image", "media": b"\x89PNG bytes", "model_id": "epd-demo"}
    assert mm_hash(**{**base, **change}) != mm_hash(**base)


def test_field_boundaries_are_unambiguous() -> None:
    # Moving bytes between adjacent fields must not collide (length-prefixed framing).
    assert mm_hash("image", b"ab", "c") != mm_hash("image", b"a", "bc")


def test_hash_is_identical_in_another_process() -> None:
    code = "from services.render.hashing import mm_hash; print(mm_hash('image', b'\\x89PNG bytes', 'epd-demo'))"
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == KNOWN
