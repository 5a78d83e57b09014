"""Client uuids are scoped by model and cache_salt: never the raw uuid, never shared across salts or models."""

from __future__ import annotations

from services.render.uuid_scope import scoped_uuid


def test_same_inputs_same_key_and_never_the_raw_uuid():
    key = scoped_uuid("epd-demo-qwen2-vl", "tenant-a", "img-1")
    assert key == scoped_uuid("epd-demo-qwen2-vl", "tenant-a", "img-1")
    assert key != "img-1" and len(key) == 64 and int(key, 16) >= 0


def test_every_input_changes_the_key():
    keys = {
        scoped_uuid("m", "tenant-a", "img-1"),
        scoped_uuid("m", "tenant-b", "img-1"),
        scoped_uuid("m", None, "img-1"),
        scoped_uuid("m", "", "img-1"),   # an empty salt is not "no salt"
        scoped_uuid("m2", "tenant-a", "img-1"),
        scoped_uuid("m", "tenant-a", "img-2"),
    }
    assert len(keys) == 6


def test_fields_are_framed():
    assert scoped_uuid("ab", "c", "d") != scoped_uuid("a", "bc", "d")
    assert scoped_uuid("m", "a", "bc") != scoped_uuid("m", "ab", "c")
