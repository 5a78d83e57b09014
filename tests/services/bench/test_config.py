from __future__ import annotations

import pytest

from services.bench.config import (
    BenchConfig,
    BenchError,
    Endpoint,
    ImageSize,
    LoadConfig,
    WorkloadConfig,
    parse_extra_body,
    parse_image_sizes,
    parse_int_list,
    parse_slo,
)


def test_image_sizes_with_and_without_weights():
    assert parse_image_sizes("224x224:0.25,448x336:0.75") == (ImageSize(224, 224, 0.25), ImageSize(448, 336, 0.75))
    assert parse_image_sizes("64") == (ImageSize(64, 64, 1.0),)
    with pytest.raises(BenchError, match="WxH"):
        parse_image_sizes("axb")


def test_slo_parsing_and_unknown_keys():
    slo = parse_slo(["ttft:500", "tpot:50"])
    assert slo.as_dict() == {"ttft": 500.0, "tpot": 50.0} and slo.is_set
    with pytest.raises(BenchError, match="supported: ttft, tpot, e2el"):
        parse_slo(["itl:5"])


def test_validation_errors_name_the_flag():
    with pytest.raises(BenchError, match="supported: random-mm, text, replay"):
        WorkloadConfig(kind="nope")
    with pytest.raises(BenchError, match="--replay-file"):
        WorkloadConfig(kind="replay")
    with pytest.raises(BenchError, match="--num-requests or --duration"):
        LoadConfig(num_requests=None)
    with pytest.raises(BenchError, match="--concurrency"):
        LoadConfig(concurrency=0)
    with pytest.raises(BenchError, match="--sweep"):
        BenchConfig((Endpoint("http://x"),), sweep=(0,))
    assert parse_int_list("1, 2,4") == (1, 2, 4)


def test_load_modes():
    assert LoadConfig().max_in_flight == 1 and not LoadConfig().is_open_loop
    assert LoadConfig(request_rate=5).max_in_flight is None and LoadConfig(request_rate=5).is_open_loop
    assert LoadConfig(request_rate=5, concurrency=3).max_in_flight == 3


def test_extra_body_must_be_a_json_object():
    assert parse_extra_body('{"ignore_eos": null}') == {"ignore_eos": None}
    assert parse_extra_body(None) == {}
    with pytest.raises(BenchError, match="JSON object"):
        parse_extra_body("[1]")
