from __future__ import annotations

import argparse

import pytest

from services.config import ConfigError, EpdConfig, add_flags, from_args, schema


def _parse(argv, env=None):
    parser = argparse.ArgumentParser()
    add_flags(parser)
    return from_args(parser.parse_args(argv), env or {})


def test_flag_beats_environment_beats_default():
    assert _parse([]).server.port == 8000
    assert _parse([], {"EPD_PORT": "9000"}).server.port == 9000
    assert _parse(["--port", "9100"], {"EPD_PORT": "9000"}).server.port == 9100


def test_booleans_and_lists():
    config = _parse(["--allow-private-media-urls", "--allowed-media-domains", "a.com, B.org"])
    assert config.limits.allow_private_media_urls is True
    assert config.limits.media_domains() == ("a.com", "b.org")
    assert _parse([], {"EPD_ALLOW_PRIVATE_MEDIA_URLS": "false"}).limits.allow_private_media_urls is False


@pytest.mark.parametrize("argv,message", [
    (["--ec-connector", "nfs"], "ec_connector must be one of shm, redis"),
    (["--decode-slots", "-1"], "decode_slots must be >= 0"),
    (["--gpu-memory-fraction", "1.5"], r"gpu_memory_fraction must be in \(0, 1\]"),
    (["--device", "cuda", "--linear-kernel", "panel"], "--linear-kernel panel: CPU-only"),
    (["--device", "cuda:1", "--decode-fused", "on", "--lm-head-screen", "on"],
     "--decode-fused on, --lm-head-screen on: CPU-only, not available with --device cuda:1"),
    (["--dtype", "int4"], "dtype must be one of"),
    (["--port", "70000"], "ports must be"),
])
def test_invalid_settings_fail_at_start_naming_the_rule(argv, message):
    with pytest.raises(ConfigError, match=message):
        _parse(argv)


def test_auto_dtype_and_decode_slots_follow_the_device_and_travel_resolved():
    cpu, cuda = _parse([]), _parse(["--device", "cuda"])
    assert (cpu.checkpoint.dtype, cpu.engines.decode_slots) == ("float32", 16)
    assert (cuda.checkpoint.dtype, cuda.engines.decode_slots) == ("bfloat16", 64)
    assert _parse(["--device", "cuda", "--dtype", "float32", "--decode-slots", "8"]).checkpoint.dtype == "float32"
    # children get the resolved values, so every process of a cluster counts the same slots
    assert cuda.to_env()["EPD_DTYPE"] == "bfloat16" and cuda.to_env()["EPD_DECODE_SLOTS"] == "64"


def test_not_a_number_names_the_flag():
    with pytest.raises(ConfigError, match="--port"):
        _parse(["--port", "eighty"])


def test_env_round_trip_reproduces_the_config():
    config = EpdConfig.of(port=1234, ec_connector="redis", allow_private_media_urls=True)
    assert _parse([], config.to_env()) == config


def test_schema_lists_every_setting_with_its_env_name():
    rows = {row["flag"]: row for row in schema()}
    assert rows["--ec-connector"]["env"] == "EPD_EC_CONNECTOR"
    assert rows["--redis-url"]["default"] == "redis://127.0.0.1:6379/0"


def test_settings_live_in_frozen_sections_built_from_flat_names():
    import dataclasses

    config = EpdConfig.of(decode_slots=4, api_key="k")
    assert (config.engines.decode_slots, config.security.api_key, config.server.port) == (4, "k", 8000)
    assert config.with_(port=9).server.port == 9 and config.server.port == 8000
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.engines.decode_slots = 5  # type: ignore[misc]
    with pytest.raises(TypeError, match="unknown settings: decode_slot"):
        EpdConfig.of(decode_slot=4)
    names = [row["flag"] for row in schema()]
    assert len(names) == len(set(names)) and {row["section"] for row in schema()} == {
        "server", "checkpoint", "stores", "cluster", "engines", "cpu", "limits", "security"}


def test_served_model_id():
    assert EpdConfig().checkpoint.served_model_id() == "epd-demo-qwen2-vl"
    assert EpdConfig.of(model="Qwen/Qwen2-VL-2B-Instruct").checkpoint.served_model_id() == "Qwen/Qwen2-VL-2B-Instruct"
    assert EpdConfig.of(served_model_name="x").checkpoint.served_model_id() == "x"
