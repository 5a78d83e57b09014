"""Capacity: measure per-stage costs, plan instances for workloads, check the plan against a real run.

    python -m benchmarks.capacity            # medium model: costs, plans, a measured check, the GPU example
    python -m benchmarks.capacity --quick    # tiny model costs and plans only (seconds)

1. Per-stage costs in process (benchmarks/stage_costs.py) with the thread count the roles use.
2. Plans (benchmarks/capacity_model.py) for a few workloads.
3. Check (full mode): an `epd serve` cluster of the same model runs a closed-loop one-image
   workload; its roles' own counters give the measured compute per request and stage, which
   is compared with the model's prediction, and its request throughput with the model's
   rate for a machine whose cores every stage shares.
4. The GPU example of docs/capacity.md (published hardware and model figures, see GPU below).
Writes benchmarks/results/capacity[_quick].json and, in full mode, docs/capacity.md's blocks.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from benchmarks.capacity_model import CostModel, Objectives, Workload, plan, shared_machine_rate
from benchmarks.common import ROOT, machine, ratio, results_dir, write_json
from benchmarks.procs import Server, metric_sum, running, start_epd
from benchmarks.stage_costs import StageCosts, measure

DOC = ROOT / "docs" / "capacity.md"

# GPU example: Qwen3-VL-4B on A100-80GB SXM, the setup of vLLM's E/P/D figure (6 -> 12 QPS at 4
# images per request on 4 GPUs).  Hardware: NVIDIA's A100 datasheet (312 TFLOPS dense BF16,
# 2.039 TB/s HBM2e).  Model: the Qwen3-VL vision tower (27 blocks, width 1152, MLP 4304, 16-pixel
# patches merged 2x2: one token per 32x32 pixels; ~0.41 B parameters) and the Qwen3-4B language
# model (~4.0 B parameters; 36 layers, 8 KV heads of 128: 144 KiB of bf16 KV per token).
# Compute-bound stages run at an assumed 40% of peak (MFU), decode at 70% of HBM bandwidth.
GPU = {"peak_flops": 312e12, "hbm_bytes_per_s": 2.039e12, "mfu": 0.40, "bandwidth_efficiency": 0.70,
       "vision_params": 0.41e9, "vision_layers": 27, "vision_width": 1152, "pixels_per_patch": 16 * 16,
       "pixels_per_token": 32 * 32, "lm_params": 4.0e9, "lm_weight_bytes": 8.0e9,
       "kv_bytes_per_token": 36 * 2 * 8 * 128 * 2, "hidden": 2560,
       "pd_orchestration_s": 0.197, "pd_kv_transfer_s": 0.029}   # vLLM's P/D handover figures (issue 4)


def gpu_costs(sizes: list[tuple[int, int]], context: int = 4096) -> StageCosts:
    """Per-stage seconds on one A100 from the constants above (estimates, not measurements)."""
    g = GPU
    costs = StageCosts("Qwen3-VL-4B on A100 (estimated)", threads=0, decode_context=context)
    flops = g["peak_flops"] * g["mfu"]
    for width, height in sizes:
        key, patches = f"{width}x{height}", width * height / g["pixels_per_patch"]
        attention = g["vision_layers"] * 4 * patches**2 * g["vision_width"]
        costs.encode_s[key] = (2 * g["vision_params"] * patches + attention) / flops
        costs.render_s[key] = 0.0   # CPU-side preprocessing: not a GPU cost (render scales on CPUs)
        costs.image_tokens[key] = int(width * height / g["pixels_per_token"])
    for tokens in (1024, 4096):
        costs.prefill_s[tokens] = 2 * g["lm_params"] * tokens / flops
    bandwidth = g["hbm_bytes_per_s"] * g["bandwidth_efficiency"]
    for batch in (1, 16, 64):
        costs.decode_step_s[batch] = (g["lm_weight_bytes"] + batch * context * g["kv_bytes_per_token"]) / bandwidth
    costs.kv_bytes_per_token, costs.embedding_bytes_per_token = g["kv_bytes_per_token"], g["hidden"] * 2
    return costs


def gpu_example() -> dict[str, Any]:
    """Instances for vLLM's workload shape (4 images/request) at 6 and 12 QPS, 512x512 and 1024x768 images."""
    sizes = [(512, 512), (1024, 768)]
    model = CostModel.from_costs(gpu_costs(sizes))
    goal = Objectives(utilisation=0.7, tpot_s=0.05, decode_slots=256)
    plans = [plan(model, Workload(rate, 4, f"{w}x{h}", text_tokens=128, output_tokens=128), goal).as_dict()
             for rate in (6.0, 12.0) for w, h in sizes]
    return {"constants": GPU, "costs": model.costs.as_dict(), "prefill_fit": model.prefill_fit,
            "decode_fit": model.decode_fit, "plans": plans}


def measured_check(server: Server, model: CostModel, workload: Workload, concurrency: int, requests: int
                   ) -> dict[str, Any]:
    """Run a closed loop on `server`; compare its per-request stage compute and throughput with the model."""
    from services.bench import BenchConfig, Endpoint, LoadConfig, WorkloadConfig, run_bench
    from services.bench.report import to_json

    width, height = (int(x) for x in workload.image_size.split("x"))
    from services.bench.config import ImageSize

    before = _stage_counters(server)
    doc = to_json(run_bench(BenchConfig(
        endpoints=(Endpoint(server.url, extra_body={"temperature": 0.0}),),
        workload=WorkloadConfig(input_len=workload.text_tokens, output_len=workload.output_tokens,
                                image_sizes=(ImageSize(width, height),), seed=31337),
        load=LoadConfig(concurrency=concurrency, num_requests=requests, timeout_s=1800), show_progress=False)))
    after = _stage_counters(server)
    delta = {k: after[k] - before[k] for k in after}
    summary = doc["levels"][0]["results"]["A"]
    done = max(summary["completed"], 1)
    batch = delta["decode_tokens"] / max(delta["decode_steps"], 1)
    prompt = summary["prompt_tokens"] / done
    steps = max(delta["decode_steps"], 1)
    measured = {"render_s": delta["render"] / done, "encode_s": delta["encode"] / done,
                "prefill_s": delta["prefill"] / done, "decode_step_s": delta["decode_step"] / steps,
                "decode_batch": batch, "request_rate": summary["request_throughput"], "prompt_tokens": prompt}
    size = workload.image_size
    predicted = {"render_s": model.costs.render_s[size], "encode_s": model.costs.encode_s[size],
                 "prefill_s": model.prefill_s(prompt), "decode_step_s": model.decode_step_s(batch),
                 "request_rate": shared_machine_rate(model, workload, batch)}
    return {"concurrency": concurrency, "requests": requests, "measured": measured, "predicted": predicted,
            "measured_over_predicted": {k: ratio(measured[k], v) for k, v in predicted.items()}}


def _stage_counters(server: Server) -> dict[str, float]:
    text = {role: server.metrics(role) for role in ("render", "encode", "prefill", "decode")}
    compute = "epd_stage_compute_seconds"
    return {"render": metric_sum(text["render"], "epd_rpc_seconds_sum", 'method="RenderChat"'),
            "encode": metric_sum(text["encode"], f"{compute}_sum", 'stage="encode"'),
            "prefill": metric_sum(text["prefill"], f"{compute}_sum", 'stage="prefill"'),
            "decode_step": metric_sum(text["decode"], f"{compute}_sum", 'stage="decode_step"'),
            "decode_steps": metric_sum(text["decode"], f"{compute}_count", 'stage="decode_step"'),
            "decode_tokens": metric_sum(text["decode"], "epd_decode_tokens_total")}


def run(quick: bool) -> dict[str, Any]:
    import torch

    size = "tiny" if quick else "medium"
    threads = torch.get_num_threads()   # what each role process uses by default
    costs = measure(size, repeats=1 if quick else 6, threads=threads,
                    prompt_lens=[64, 256] if quick else [128, 256, 512],
                    batches=[1, 8] if quick else [1, 4, 8, 16])
    model = CostModel.from_costs(costs)
    shape = Workload(request_rate=0.5, images_per_request=1, image_size="224x224", text_tokens=64, output_tokens=64)
    plans = [plan(model, Workload(rate, k, "224x224", 64, 64), Objectives()).as_dict()
             for rate in (0.5, 2.0) for k in (1, 4)]
    result: dict[str, Any] = {"machine": machine(), "costs": costs.as_dict(), "prefill_fit": model.prefill_fit,
                              "decode_fit": model.decode_fit, "plans": plans, "gpu_example": gpu_example()}
    if not quick:
        from services.models.demo import demo_model_path

        with running(start_epd(str(demo_model_path(size)))) as (epd,):
            result["check"] = measured_check(epd, model, shape, concurrency=8, requests=24)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-docs", action="store_true")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    result = run(args.quick)
    from benchmarks.capacity_report import print_report, write_blocks

    print_report(result)
    write_json(result, results_dir(args.quick) / f"capacity{'_quick' if args.quick else ''}.json")
    if not args.quick and not args.no_docs:
        write_blocks(result, DOC, "python -m benchmarks.capacity " + " ".join(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
