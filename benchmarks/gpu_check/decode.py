"""Decode tok/s at 1, 16 and 64 streams against Hugging Face `generate` at those batch sizes, and the host
synchronisations per decode step, on the medium demo model (services/models/demo.py, bfloat16 on CUDA).

epd: the decode engine (services/decode/gpu_runner.py, one CUDA graph per bucket 1, 16, 64) decodes
`TOKENS` tokens per stream from a prefilled KV of `PROMPT_LEN` random tokens; tok/s = tokens it produced / wall
time (the first token is prefill's and not counted).  Hugging Face: `generate` greedily on a batch of random
prompts of the same length; its decode time is generate(TOKENS new tokens) - generate(1) (its prefill taken out),
tok/s = batch x (TOKENS - 1) / that.  Both best of two runs after a warm-up.

Syncs: with every one of 16 streams in its rows, the CUDA profiler (torch.profiler, CUPTI) counts the runtime
calls that make the host wait (cudaStreamSynchronize, cudaDeviceSynchronize, cudaEventSynchronize, cudaMemcpy)
over a window of steps; torch's sync debug mode names torch-level sources meanwhile.  A step reads its sampled
tokens back once: the figure is the count per step beyond that one.
"""

from __future__ import annotations

import time
import warnings
from collections import Counter
from typing import Any

from benchmarks.gpu_check.common import Run, sync

STREAMS = (1, 16, 64)
TOKENS = 64
PROMPT_LEN = 256
SYNC_CALLS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"}


def _engine_tok_s(engine: Any, lm: Any, run: Run, streams: int, tokens: int, prompt_len: int, tag: str) -> float:
    import torch

    from services.generation.params import DecodeParams

    layout = lm.layout
    params = DecodeParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    kvs = [torch.randn(layout.num_layers, 2, layout.num_kv_heads, prompt_len, layout.head_dim, device=run.device,
                       dtype=layout.dtype) for _ in range(streams)]
    sync(run.device)
    started = time.perf_counter()
    handles = [engine.submit(f"{tag}{i}", kv, prompt_len, 0, 100 + i, params) for i, kv in enumerate(kvs)]
    produced = sum(h.collect(timeout=300)[-1].completion_tokens - 1 for h in handles)
    return produced / (time.perf_counter() - started)


def _hf_tok_s(hf: Any, run: Run, batch: int, tokens: int, prompt_len: int) -> float:
    import torch

    ids = torch.randint(0, 150000, (batch, prompt_len), device=run.device)

    def generate(new: int) -> float:
        sync(run.device)
        started = time.perf_counter()
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                        do_sample=False)
        sync(run.device)
        return time.perf_counter() - started

    generate(2)   # warm-up
    decode = min(generate(tokens) - generate(1) for _ in range(2))
    return batch * (tokens - 1) / decode


def _syncs(engine: Any, lm: Any, run: Run, streams: int, prompt_len: int, window: int) -> dict[str, Any]:
    import torch

    from services.generation.params import DecodeParams

    layout = lm.layout
    params = DecodeParams(temperature=0.0, max_tokens=window * 4 + 50, ignore_eos=True)
    handles = [engine.submit(f"sync{i}", torch.randn(layout.num_layers, 2, layout.num_kv_heads, prompt_len,
                                                     layout.head_dim, device=run.device, dtype=layout.dtype),
                             prompt_len, 0, 7 + i, params) for i in range(streams)]
    deadline = time.monotonic() + 60
    while engine.stats().active < streams and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)   # a few steps with every row in
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if run.cuda else [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if run.cuda:
            torch.cuda.set_sync_debug_mode("warn")
        with torch.profiler.profile(activities=activities) as prof:
            first = engine.stats().steps
            while engine.stats().steps < first + window and time.monotonic() < deadline:
                time.sleep(0.002)
            steps = engine.stats().steps - first
        if run.cuda:
            torch.cuda.set_sync_debug_mode("default")
    for i in range(streams):
        engine.abort(f"sync{i}")
    for handle in handles:
        handle.collect(timeout=60)
    calls = Counter(event.name for event in prof.events() if event.name in SYNC_CALLS)
    sources = Counter(str(w.message).splitlines()[0][:160] for w in caught if "synchroniz" in str(w.message))
    total = sum(calls.values())
    return {"streams": streams, "steps": steps, "calls": dict(calls), "per_step": total / steps if steps else None,
            "beyond_readback": max(0.0, total / steps - 1) if steps and run.cuda else None,
            "torch_sources": dict(sources.most_common(8))}


def run(run: Run) -> dict[str, Any]:
    import torch
    from transformers import Qwen2VLForConditionalGeneration

    from services.decode.engine import DecodeEngine
    from services.models.demo import demo_model_path
    from services.models.processing import load_tokenizer
    from services.models.registry import adapter_for

    # the dry run: a pool of 2 MiB (eager flex on CPU reads the whole pool for every row)
    streams, tokens, prompt_len, max_len, pool = (((1, 2), 6, 32, 512, 2 << 20) if run.dry_run
                                                 else (STREAMS, TOKENS, PROMPT_LEN, 4096, 1 << 30))
    path = demo_model_path("tiny" if run.dry_run else "medium")
    dtype = "bfloat16" if run.cuda else "float32"
    lm = adapter_for(path).load_language(path, run.device, dtype, max_len)
    started = time.monotonic()
    engine = DecodeEngine(lm, load_tokenizer(path), max(streams), max_len, kv_cache_bytes=pool, graph_buckets=streams,
                          attention="auto" if run.cuda else "flex", stream_timeout=300)
    out: dict[str, Any] = {"model": path.name, "dtype": dtype, "tokens": tokens, "prompt_len": prompt_len,
                           "engine_start_s": time.monotonic() - started, "step": engine.step_report.line()}
    try:
        _engine_tok_s(engine, lm, run, 1, 4, prompt_len, "warm")
        out["epd_tok_s"] = {n: max(_engine_tok_s(engine, lm, run, n, tokens, prompt_len, f"r{r}n{n}-")
                                   for r in range(2)) for n in streams}
        out["syncs"] = _syncs(engine, lm, run, streams[1], prompt_len, 10 if run.dry_run else 30)
        out["graph_replays"] = engine.graph_replays
    finally:
        engine.close()
    del lm
    hf: Any = Qwen2VLForConditionalGeneration.from_pretrained(str(path), dtype=getattr(torch, dtype))
    hf = hf.to(run.device).eval()
    out["hf_tok_s"] = {n: _hf_tok_s(hf, run, n, tokens, prompt_len) for n in streams}
    out["ratio"] = {n: out["epd_tok_s"][n] / out["hf_tok_s"][n] for n in streams}
    return out
