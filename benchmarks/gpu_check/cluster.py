"""A real `epd serve --device cuda`: every role on the GPU, embeddings and KV by CUDA IPC (the shm connectors).

The tiny Qwen2-VL demo checkpoint, in the dtype the device defaults to (bfloat16 on CUDA), decode slots 4 (one
CUDA graph, of 4 rows).  Exactness: a text and a one-image chat, greedy through the coordinator, must give
`generate`'s tokens on the same GPU in the same dtype (tests/support/reference.py).  TTFT at c=1: streamed chats
one after another, time from sending the body to the first content delta.  The roles' start-up lines (the GPU
budget, the decode step's capture) are kept in the JSON.
"""

from __future__ import annotations

import json
import time
from typing import Any

from benchmarks.gpu_check.common import Run, median

MAX_TOKENS = 8
TTFT_REQUESTS = 6


def _ttft(cluster: Any, body: dict[str, Any]) -> float:
    with cluster.client(timeout=60) as client:
        started = time.perf_counter()
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as reply:
            reply.raise_for_status()
            for line in reply.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    delta = json.loads(line[6:])["choices"][0].get("delta", {})
                    if delta.get("content"):
                        return time.perf_counter() - started
    raise RuntimeError("the stream ended without content")


def run(run: Run) -> dict[str, Any]:
    from services.config import EpdConfig
    from services.models.tiny import tiny_model_path
    from tests.support.cluster import start_cluster
    from tests.support.images import chat, noise_image
    from tests.support.reference import Reference

    path = tiny_model_path("qwen2_vl")
    dtype = EpdConfig.of(device=run.device).checkpoint.dtype
    # 4 rows: three CUDA graphs (1, 2, 4), so the section's time goes to requests, not to capturing buckets
    cluster = start_cluster("--model", str(path), "--device", run.device, "--decode-slots", "4",
                            "--ec-capacity-mb", "64", "--kv-capacity-mb", "64",
                            "--gpu-memory-fraction", "0.5", "--max-model-len", "4096", timeout=150)
    out: dict[str, Any] = {"dtype": dtype, "startup": [line.strip() for line in cluster.output
                                                       if "budget" in line or "decode engine:" in line][:8]}
    try:
        reference = Reference(path, device=run.device, dtype=dtype)
        cases = {"text": ("Tell me a story about a lighthouse.", []),
                 "image": ("Describe this image.", [noise_image(448, 448, 1)])}
        rows = []
        for case, (text, images) in cases.items():
            body = chat(text, images, max_tokens=MAX_TOKENS, temperature=0, return_token_ids=True)
            with cluster.client(timeout=120) as client:
                reply = client.post("/v1/chat/completions", json=body)
            got = reply.json()["choices"][0]["token_ids"] if reply.status_code == 200 else reply.text[:500]
            want = reference.greedy(text, images, MAX_TOKENS)
            rows.append({"case": case, "identical": got == want, "epd": got, "hf": want})
        out["cases"], out["identical"], out["total"] = rows, sum(r["identical"] for r in rows), len(rows)
        text_body = chat("Say something.", [], max_tokens=4, temperature=0)
        _ttft(cluster, text_body)   # warm
        out["ttft_text_ms"] = median([_ttft(cluster, text_body) * 1e3 for _ in range(TTFT_REQUESTS)])
        # a new image each time: the encoder cache would answer a repeated one without encoding it
        out["ttft_image_ms"] = median([_ttft(cluster, chat("Describe this image.", [noise_image(448, 448, 10 + i)],
                                                           max_tokens=4, temperature=0)) * 1e3
                                       for i in range(TTFT_REQUESTS // 2)])
    finally:
        cluster.stop(timeout=60)
    return out
