"""Encoder-cache hit ratio from Prometheus counters, before/after deltas."""

from __future__ import annotations

import pytest

from services.bench import WorkloadConfig
from services.bench.config import ImageSize
from services.bench.prom import counters, delta, hit_ratio, parse_text
from tests.services.bench.conftest import bench, summary

EXPOSITION = """# HELP epd_encode_items_total Items
# TYPE epd_encode_items_total counter
epd_encode_items_total{result="encoded",instance="a"} 3.0
epd_encode_items_total{result="cache_hit"} 5.0
epd_encode_items_created{result="encoded"} 1.7e9
epd_coordinator_encode_calls_total 8.0
epd_coordinator_ec_known_hits_total 2.0
"""


def test_parse_and_ratio():
    samples = parse_text(EXPOSITION)
    assert samples[("epd_encode_items_total", (("instance", "a"), ("result", "encoded")))] == 3.0
    c = counters(samples)
    assert c == {"known_hits": 2.0, "encode_calls": 8.0, "encoded": 3.0, "cache_hit": 5.0, "items_known": None,
                 "items_cache_hit": None, "items_encoded": None, "items_inline": None, "frame_groups_hit": None,
                 "frame_groups_encoded": None}
    assert hit_ratio(c)["hit_ratio"] == pytest.approx(7 / 10)   # an older coordinator: its two counters
    assert hit_ratio(c)["frame_groups"] is None   # no video frame groups looked up


def test_frame_group_hit_ratio():
    samples = parse_text(EXPOSITION + '\nepd_encode_frame_groups_total{result="cache_hit"} 6.0\n'
                         'epd_encode_frame_groups_total{result="encoded"} 10.0\n')
    groups = hit_ratio(counters(samples))["frame_groups"]
    assert groups == {"groups": 16.0, "hits": 6.0, "hit_ratio": pytest.approx(6 / 16)}


def test_the_coordinators_count_by_source_is_the_ratio():
    """The coordinator counts each image once by where its embedding came from: here 2 known, 1 from encode's cache,
    3 encoded, 1 inline; encode's own counters (3 cache hits here) do not decide the ratio when these are given."""
    samples = parse_text(EXPOSITION.replace("cache_hit\"} 5.0", "cache_hit\"} 3.0") + "\n".join(
        f'epd_coordinator_mm_items_total{{source="{source}"}} {n}'
        for source, n in (("known", 2.0), ("cache_hit", 1.0), ("encoded", 3.0), ("inline", 1.0))))
    ratio = hit_ratio(counters(samples))
    assert (ratio["items"], ratio["hits"], ratio["encoded"]) == (7.0, 3.0, 3.0)
    assert ratio["hit_ratio"] == pytest.approx(3 / 7) and ratio["encoded_ratio"] == pytest.approx(3 / 7)


def test_delta_and_coordinator_only_fallback():
    before = {"known_hits": 1.0, "encode_calls": 4.0, "encoded": None, "cache_hit": None}
    after = {"known_hits": 4.0, "encode_calls": 10.0, "encoded": None, "cache_hit": None}
    d = delta(before, after)
    assert d["known_hits"] == 3.0 and d["encoded"] is None
    assert hit_ratio(d)["hit_ratio"] == pytest.approx(3 / 9) and hit_ratio(d)["encoded_ratio"] is None
    encode_only = {"known_hits": None, "encode_calls": None, "encoded": 3.0, "cache_hit": 5.0}
    assert hit_ratio(encode_only)["hit_ratio"] == pytest.approx(5 / 8)


def test_hit_ratio_of_a_run_with_image_reuse(fake):
    server = fake()
    server_metrics = server.url  # the fake server's /fake/<spec>/metrics counts this spec's images
    workload = WorkloadConfig(input_len=4, output_len=2, image_pool=5, image_sizes=(ImageSize(32, 32),))
    bench([server.url], workload=workload, metrics=(server_metrics,), num_requests=6)  # counters start non-zero
    other_images = WorkloadConfig(**{**workload.__dict__, "seed": 1})
    _, doc = bench([server.url], workload=other_images, metrics=(server_metrics,), num_requests=40)
    s = summary(doc)
    assert s["images"] == {"images": 40, "distinct_images": 5, "ideal_hit_ratio": pytest.approx(35 / 40)}
    cache = s["encoder_cache"]
    # the second run's 5 images are new (another seed); the deltas leave the first run out
    assert cache["items"] == 40 and cache["hit_ratio"] == pytest.approx(35 / 40) and cache["encoded"] == 5
    assert cache["counters"]["known_hits"] > 0 and cache["counters"]["cache_hit"] > 0
    assert server.stats()["distinct_images"] == 10


def test_unreachable_metrics_are_reported_not_fatal(fake):
    _, doc = bench([fake().url], metrics=("http://127.0.0.1:9/metrics",), num_requests=2)
    s = summary(doc)
    assert s["completed"] == 2 and s["encoder_cache"] is None and "cannot scrape" in s["metrics_error"]
