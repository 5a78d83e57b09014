"""benchmarks/open_loop.py: its `vllm bench serve` command line and figures from a document (no servers).  Its
--quick run end to end, which needs the vLLM peer venv (the load generator), is in tests/interop/test_open_loop.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from benchmarks import docpage, open_loop


def test_the_bench_command_is_the_users_poisson_run():
    setup = open_loop.Setup()
    cmd = open_loop.bench_command(setup, "http://127.0.0.1:9", Path("/m"), "image", 2.0, Path("/r/x.json"), seed=7)
    joined = " ".join(cmd)
    assert cmd[1:3] == ["bench", "serve"] and cmd[0].endswith("/bin/vllm")
    for part in ("--backend openai-chat", "--dataset-name random-mm", "--random-mm-base-items-per-request 1",
                 "{(224, 224, 1): 1.0}", "--random-input-len 64", "--random-output-len 48", "--ignore-eos",
                 "--request-rate 2.0", "--goodput ttft:2000 tpot:100", "--result-dir /r", "--result-filename x.json",
                 "--tokenizer /m", "--model bench-model", "--seed 7", "--save-detailed"):
        assert part in joined, part
    text = " ".join(open_loop.bench_command(setup, "u", Path("/m"), "text", 0.5, Path("/r/y.json")))
    assert "--dataset-name random " in text and "random-mm" not in text


def test_a_result_keeps_each_requests_start_and_ttft_not_the_long_lists():
    raw = {"median_ttft_ms": 90.0, "ttfts": [0.0912, 0.0, 0.30049], "start_times": [100.5, 100.75, 101.2504],
           "errors": ["", "Traceback ...\n  ...\naiohttp.ServerDisconnectedError: Server disconnected\n", ""],
           "itls": [[0.02]], "generated_texts": ["a", "", "b"], "completed": 2}
    assert open_loop.compact(raw) == {"median_ttft_ms": 90.0, "completed": 2, "requests": {
        "start_s": [0.0, 0.25, 0.75], "ttft_ms": [91.2, None, 300.5],
        "errors": {"1": "aiohttp.ServerDisconnectedError: Server disconnected"}}}
    assert open_loop.compact({"median_ttft_ms": 1.0}) == {"median_ttft_ms": 1.0}   # a result saved without details


def test_figures_are_epd_over_the_baseline_per_workload_and_rate():
    def result(ttft, p99, tpot, good, failed=0):
        return {"median_ttft_ms": ttft, "p99_ttft_ms": p99, "median_tpot_ms": tpot, "request_goodput": good,
                "failed": failed}

    doc = {"setup": {"workloads": ["image"], "rates": [1.0, 2.0]}, "baseline": "vllm",
           "runs": [{"workload": "image", "rate": 1.0, "side": "A", "result": result(300, 600, 50, 1.0, failed=3)},
                    {"workload": "image", "rate": 1.0, "side": "B", "result": result(200, 400, 40, 0.5)},
                    {"workload": "image", "rate": 2.0, "side": "A", "result": result(100, 100, 10, 1.0)}]}
    found = {f.name: f for f in open_loop.figures(doc)}
    assert sorted(found) == ["TPOT p50, image, 1 req/s, epd / vllm", "TTFT p50, image, 1 req/s, epd / vllm",
                             "TTFT p99, image, 1 req/s, epd / vllm", "goodput, image, 1 req/s, epd / vllm"]
    assert found["TTFT p50, image, 1 req/s, epd / vllm"].value == 1.5
    assert found["TTFT p50, image, 1 req/s, epd / vllm"].note == "300.0 vs 200.0 ms"
    assert found["TPOT p50, image, 1 req/s, epd / vllm"].value == 1.25
    assert found["goodput, image, 1 req/s, epd / vllm"].value == 2.0 and found["goodput, image, 1 req/s, "
                                                                              "epd / vllm"].op == "ge"
    assert found["goodput, image, 1 req/s, epd / vllm"].note == "1.0 vs 0.5 req/s; failed 3 vs 0"   # epd's 429s
    doc["runs"][0]["result"]["requests"] = {"errors": {"4": "Too Many Requests", "9": "Too Many Requests",
                                                       "12": "aiohttp.ServerDisconnectedError: Server disconnected"}}
    found = {f.name: f for f in open_loop.figures(doc)}
    assert found["goodput, image, 1 req/s, epd / vllm"].note == \
        "1.0 vs 0.5 req/s; failed 3 vs 0 (2 429, 1 disconnected / -)"   # why, where the run kept it
    doc["runs"][0]["result"]["refused"] = {"tpot_slo": 1, "ttft_slo": 1}   # epd's /metrics: which rule refused
    found = {f.name: f for f in open_loop.figures(doc)}
    assert found["goodput, image, 1 req/s, epd / vllm"].note == \
        "1.0 vs 0.5 req/s; failed 3 vs 0 (2 429 (1 tpot_slo, 1 ttft_slo), 1 disconnected / -)"


def test_refusals_are_read_off_the_coordinators_metrics():
    text = ('# HELP epd_coordinator_rejected_requests_total Requests refused\n'
            'epd_coordinator_rejected_requests_total{reason="ttft_slo"} 3.0\n'
            'epd_coordinator_rejected_requests_total{reason="tpot_slo"} 1.0\n'
            'epd_coordinator_rejected_requests_created{reason="ttft_slo"} 1.7e+09\n')
    assert dict(open_loop.REFUSED.findall(text)) == {"ttft_slo": "3.0", "tpot_slo": "1.0"}


def test_baseline_flags_go_to_an_epd_baseline_only(capsys):
    setup, docs = open_loop.parse(["--baseline", "self", "--baseline-flag=--role-nice=decode=0", "--rates", "1,2",
                                   "--name", "nice0"])
    assert setup.baseline_flags == ("--role-nice=decode=0",) and setup.epd_flags == () and not docs
    assert setup.rates == (1.0, 2.0) and setup.seed == 0
    assert open_loop.parse(["--rates", "2", "--seed", "1"])[0].seed == 1   # a wider run's 2nd rate, replayed
    with pytest.raises(SystemExit):
        open_loop.parse(["--baseline-flag=--role-nice=decode=0"])   # the vLLM baseline takes no epd flag
    assert "--baseline-flag needs an epd baseline" in capsys.readouterr().err


def test_each_shape_runs_under_its_own_name_and_docs_block(monkeypatch):
    assert open_loop.parse([]) == (open_loop.Setup(), True)                  # demo-medium: open_loop, `open-loop`
    deep, docs = open_loop.parse(["--model", "demo-deep"])
    assert (deep.name, docs) == ("open_loop_deep", True)
    smol, docs = open_loop.parse(["--model", "smollm2", "--workloads", "text"])
    assert (smol.name, smol.workloads, docs) == ("open_loop_smollm2", ("text",), True)
    assert open_loop.parse(["--model", "demo-deep", "--name", "trial"])[1] is False   # another name: no docs
    assert open_loop.parse(["--model", "demo-deep", "--baseline", "self"])[1] is False   # not beside vLLM
    assert open_loop.parse(["--quick"])[0].name == "open_loop_quick"
    assert open_loop.parse(["--model", "/ckpt/Qwen2-VL-2B"]) == (open_loop.Setup(
        model="/ckpt/Qwen2-VL-2B", name="open_loop_Qwen2_VL_2B"), False)   # not a known shape: its own JSON only
    assert {name.replace("_", "-") for name in (*open_loop.SHAPES.values(), *open_loop.DOC_RUNS)} <= set(
        name for _, names in docpage.GROUPS for name in names)
    tail, docs = open_loop.parse(["--model", "smollm2", "--rates", "1,2,3", "--name", "open_loop_smollm2_tail"])
    assert (tail.name, docs) == ("open_loop_smollm2_tail", True)     # a named run with a block of its own
    assert open_loop.parse(["--name", "open_loop_overload", "--baseline", "self"])[1] is False
    assert open_loop.parse(["--model", "smollm2", "--name", "open_loop_nice", "--baseline", "self",
                            "--baseline-flag=--role-nice=decode=15"])[1] is True    # an A/B run with a block
    assert open_loop.parse(["--model", "smollm2", "--name", "open_loop_nice"])[1] is False   # not its baseline
    # a git ref is named by its commit (a branch moves on), and a named A/B's block is beside that commit only
    head = subprocess.run(["git", "-C", str(open_loop.ROOT), "rev-parse", "--short=7", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    monkeypatch.setitem(open_loop.DOC_RUNS, "open_loop_ab_trial", head)
    trial, docs = open_loop.parse(["--name", "open_loop_ab_trial", "--baseline", "HEAD"])
    assert (trial.baseline, docs) == (head, True)
    assert open_loop.parse(["--name", "open_loop_ab_trial", "--baseline", "self"])[1] is False
    with pytest.raises(SystemExit, match="--baseline no-such-ref: not a git ref"):
        open_loop.parse(["--baseline", "no-such-ref"])


def test_epd_runs_with_the_goodput_slo_as_its_admission_targets_unless_told_not_to():
    setup, _ = open_loop.parse(["--epd-flag=--decode-slots=8"])
    assert setup.slo and open_loop.epd_flags(setup) == ("--ttft-slo-ms", "2000", "--tpot-slo-ms", "100",
                                                         "--decode-slots=8")
    assert open_loop.GOODPUT == ("ttft:2000", "tpot:100")   # the SLO the flags repeat
    bare, _ = open_loop.parse(["--no-slo"])
    assert not bare.slo and open_loop.epd_flags(bare) == ()


def test_the_rate_plot_draws_both_sides_from_the_json(tmp_path):
    from PIL import Image

    def result(ttft, tpot, good):
        return {"median_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft, "median_tpot_ms": tpot, "request_goodput": good}

    doc = {"setup": {"model": "demo-medium", "num_prompts": 40}, "baseline": "vllm-serve",
           "runs": [{"workload": "image", "rate": rate, "side": side, "result": result(100 * rate, 20 * rate, rate)}
                    for rate in (0.5, 1.0, 2.0) for side in ("A", "B")]}
    path = tmp_path / "open_loop_image.png"
    open_loop.plot(doc, "image", path)
    with Image.open(path) as image:
        assert image.format == "PNG" and image.width == 2 * 560 and image.height > 2 * 400
        colors = {color for _, color in image.getcolors(1 << 20)}
    assert (31, 119, 180) in colors and (255, 127, 14) in colors    # a line for epd and one for the baseline
