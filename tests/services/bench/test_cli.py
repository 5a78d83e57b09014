"""`epd bench` end to end through services.runtime.cli: text, JSON schema, PNG plots, sweep, calibration."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from services.runtime.cli import main as epd_main

SUMMARY_KEYS = {"completed", "failed", "errors", "duration_s", "request_throughput", "output_throughput",
                "total_token_throughput", "prompt_tokens", "output_tokens", "usage_reported", "ttft_ms", "tpot_ms",
                "itl_ms", "e2el_ms", "client", "images", "encoder_cache"}
STAT_KEYS = {"n", "mean", "std", "min", "p50", "p90", "p99", "max"}


def _png(path):
    with open(path, "rb") as handle:
        assert handle.read(8) == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        return image.size


def test_single_run_writes_json_and_cdf_plot(fake, tmp_path, capsys):
    server = fake("ttft=0.01,itl=0.002")
    out, plots = tmp_path / "r.json", tmp_path / "plots"
    rc = epd_main(["bench", server.url, "--num-requests", "10", "--concurrency", "2", "--output-len", "4",
                   "--image-sizes", "32x32:0.5,48x48:0.5", "--image-pool", "3", "--goodput", "ttft:500",
                   "tpot:50", "--output", str(out), "--plot-dir", str(plots), "--no-progress",
                   "--save-requests", "--metrics-url", server.url])
    assert rc == 0
    text = capsys.readouterr().out
    assert "Request throughput (req/s):" in text and "Goodput (req/s) [ttft<=500ms tpot<=50ms]:" in text
    assert "Encoder-cache hits, measured / ideal:   0.700 / 0.700 of 10 items\n" in text
    doc = json.loads(out.read_text())
    assert doc["schema"] == "epd-bench/1" and doc["mode"] == "single" and "vLLM" in doc["definitions"]
    assert doc["endpoints"]["A"]["model"] == "fake-model"
    assert doc["config"]["workload"]["image_pool"] == 3 and doc["config"]["load"]["request_rate"] is None
    level = doc["levels"][0]
    assert level["concurrency"] == 2 and "ratios" not in level
    s = level["results"]["A"]
    assert SUMMARY_KEYS <= set(s) and STAT_KEYS == set(s["ttft_ms"])
    assert s["images"]["distinct_images"] == 3 and s["encoder_cache"]["hit_ratio"] == 0.7
    assert len(s["requests"]) == 10 and s["requests"][0]["ok"] is True
    assert _png(plots / "latency_cdf.png") == (1120, 856)   # 2 x 2 panels under a two-line title


def _hit_ratios(fake_endpoint, tmp_path, name: str, *seed: str) -> tuple[float, float, int]:
    out = tmp_path / f"{name}.json"
    assert epd_main(["bench", fake_endpoint.url, "--num-requests", "10", "--output-len", "2", "--image-sizes",
                     "32x32", "--image-pool", "3", "--metrics-url", fake_endpoint.url, "--output", str(out),
                     "--no-progress", *seed]) == 0
    doc = json.loads(out.read_text())
    s = doc["levels"][0]["results"]["A"]
    return s["encoder_cache"]["hit_ratio"], s["images"]["ideal_hit_ratio"], doc["config"]["seed"]


def test_two_runs_against_one_server_measure_the_same_hit_ratio(fake, tmp_path, capsys):
    server = fake()  # its encoder-cache counters remember every image they saw, as a real cluster's do
    first, second = _hit_ratios(server, tmp_path, "first"), _hit_ratios(server, tmp_path, "second")
    assert first[:2] == second[:2] == (0.7, 0.7) and first[2] != second[2]   # fresh images each run
    text = capsys.readouterr()
    assert f"seed {second[2]} (random: --seed {second[2]} sends the same requests again)" in text.out
    assert f"wrote {tmp_path / 'second.json'} (the full results, epd-bench/1)" in text.err
    # a given seed sends the same images again: then the server has them all (the old default's trap)
    again = _hit_ratios(server, tmp_path, "again", "--seed", str(second[2]))
    assert again == (1.0, 0.7, second[2])
    assert f"seed {second[2]} (given)" in capsys.readouterr().out


def test_sweep_compare_and_calibration(fake, tmp_path, capsys):
    a, b = fake("ttft=0.01"), fake("ttft=0.02")
    out, plots = tmp_path / "s.json", tmp_path / "plots"
    rc = epd_main(["bench", "--compare", a.url, b.url, "--workload", "text", "--input-len", "8", "--output-len",
                   "3", "--num-requests", "6", "--sweep", "1,2,4", "--calibrate", "--output", str(out),
                   "--plot-dir", str(plots), "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "client calibration (null server)" in text and "B/A (concurrency 4)" in text and " sweep " in text
    doc = json.loads(out.read_text())
    assert doc["mode"] == "compare" and [lv["concurrency"] for lv in doc["levels"]] == [1, 2, 4]
    assert all({"A", "B"} == set(lv["results"]) and lv["ratios"] for lv in doc["levels"])
    assert doc["calibration"]["concurrency"] == 4 and doc["calibration"]["failed"] == 0
    assert doc["calibration"]["request_throughput"] > 50
    assert _png(plots / "sweep.png") == (1680, 478)          # 3 panels under a three-line title
    for level in (1, 2, 4):
        _png(plots / f"latency_cdf_c{level}.png")
    # every level gets fresh requests (its own seed), both endpoints the same ones
    assert len(set(a.stats()["bodies"])) == 18 and sorted(a.stats()["bodies"]) == sorted(b.stats()["bodies"])


def test_replay_file_through_the_cli(fake, tmp_path, capsys):
    server = fake()
    path = tmp_path / "requests.jsonl"
    bodies = [{"messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": i + 1} for i in range(3)]
    path.write_text("".join(json.dumps(b) + "\n" for b in bodies))
    out = tmp_path / "r.json"
    rc = epd_main(["bench", server.url, "--workload", "replay", "--replay-file", str(path), "--num-requests", "6",
                   "--output", str(out), "--no-progress"])
    assert rc == 0
    s = json.loads(out.read_text())["levels"][0]["results"]["A"]
    assert s["completed"] == 6 and s["output_tokens"] == 2 * (1 + 2 + 3)
    assert len(set(server.stats()["bodies"])) == 3


def test_usage_errors_exit_2(capsys):
    assert epd_main(["bench", "--num-requests", "3"]) == 2
    assert "give one endpoint URL" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        epd_main(["bench", "http://127.0.0.1:9", "--image-sizes", "0x5"])
    assert exit_info.value.code == 2 and "sides and weight must be > 0" in capsys.readouterr().err
    assert epd_main(["bench", "http://127.0.0.1:9", "--goodput", "itl:3"]) == 2
