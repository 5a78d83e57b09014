"""mm_hash: deterministic across calls and processes, sensitive to every input, uuid used as is."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from services.render.hashing import canonical_json, item_hash, mm_hash, output_kwargs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
KWARGS = {"merge_size": 2, "patch_size": 14, "size": {"shortest_edge": 3136, "longest_edge": 12845056}}
# Pinned so a change of the framing (which would orphan every cached embedding) is a visible decision.
KNOWN = "16a4004eea5ee103633104fe5baa2c5ae9aa0d1ceccbc7edc5970f2cc8bb6cd6"


def test_hash_is_hex_sha256_and_stable() -> None:
    first = mm_hash("image", b"\x89PNG bytes", "epd-demo", KWARGS)
    assert first == mm_hash("image", b"\x89PNG bytes", "epd-demo", dict(reversed(list(KWARGS.items()))))
    assert len(first) == 64 and int(first, 16) >= 0
    assert first == KNOWN


@pytest.mark.parametrize("change", [
    {"modality": "video"}, {"media": b"\x89PNG bytez"}, {"model_id": "other-model"},
    {"processor_kwargs": {**KWARGS, "merge_size": 3}}, {"processor_kwargs": {}},
])
def test_every_input_changes_the_hash(change: dict) -> None:
    base = {"modality": "image", "media": b"\x89PNG bytes", "model_id": "epd-demo",
            "processor_kwargs": KWARGS}
    assert mm_hash(**{**base, **change}) != mm_hash(**base)


def test_field_boundaries_are_unambiguous() -> None:
    # Moving bytes between adjacent fields must not collide (length-prefixed framing).
    assert mm_hash("image", b"ab", "c", {}) != mm_hash("image", b"a", "bc", {})


def test_uuid_is_used_as_is() -> None:
    assert item_hash("image", b"x", "m", KWARGS, "my-uuid-1") == "my-uuid-1"
    assert item_hash("image", b"x", "m", KWARGS, None) == mm_hash("image", b"x", "m", KWARGS)


def test_canonical_json_sorts_keys_and_unifies_tuples() -> None:
    expected = b'{"a":1,"b":[1,2]}'
    assert canonical_json({"b": (1, 2), "a": 1}) == canonical_json({"a": 1, "b": [1, 2]}) == expected


def test_output_kwargs_drop_names_that_do_not_change_output() -> None:
    settings = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "X", "_private": 1,
                "merge_size": 2}
    assert output_kwargs(settings) == {"merge_size": 2}


def test_hash_is_identical_in_another_process() -> None:
    code = ("from services.render.hashing import mm_hash; "
            f"print(mm_hash('image', b'\\x89PNG bytes', 'epd-demo', {KWARGS!r}))")
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == KNOWN
