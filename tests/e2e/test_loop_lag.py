"""The coordinator's event loop keeps answering while it takes in a 20 MB features request.

A real cluster (the shared shm one) gets a /inference/v1/generate request whose kwargs_data is render's
own item for a 1024x768 image with its pixels as float32: ~20 MB of JSON, nearly all one base64 string.
The coordinator reads the body, parses it, decodes the base64, unpacks the msgpack and writes the tensors
into its mm store, and only then finds that max_tokens cannot fit (a 400 naming the context length), so
the request costs the coordinator's own work and nothing else.  Meanwhile a probe thread asks its
/health every few ms; the slowest answer is how long the loop stalled, plus scheduling noise.

The yardstick is the longest single call the old path made, timed in this process on the same body:
`json.loads` of the body or `binascii.a2b_base64` of the item's string, each one C call holding the GIL,
so code that runs either on the loop or in a worker thread stalls the loop at least that long.  The bound,
half of it, is broken by any such call on the path.  Noise only adds lag (a loaded 2-core box
deschedules the coordinator's threads at any time), so the best of up to five requests, a second apart,
is judged; the failure message also gives each one's slowest answer in the quiet 0.4 s before it (the
box's own noise, apart from the request).

The probe runs in this pytest process, which in a full suite holds torch, transformers and a thousand
tests' objects: one full cyclic collection here takes ~0.2-0.3 s (0.17 s with just torch and
transformers imported) and pauses the probe thread for that long.  The cyclic GC is therefore off in
this process while a request is timed.  (One CI run saw 260-390 ms in all three of its tries, the
requests 3-4x slower than here.  Counting the coordinator's page faults points at why: each 20 MB
request took ~21,000 fresh pages, each faulted inside a copy that holds the GIL, and on a freshly booted
VM a fault is slow (not measured there).  The coordinator now keeps freed memory for reuse (coordinator/main.py
keep_freed_memory: 1,700-9,000 faults per request here), and the first request, which also creates the
mm store's pool and grows the heap to fit, is sent once untimed.)
"""

from __future__ import annotations

import binascii
import gc
import json
import threading
import time

import httpx
import numpy as np
from PIL import Image

from services.protocol.items import FieldElem
from services.protocol.serialization import item_from_b64, item_to_b64
from tests.support.images import chat

TOO_MANY = 1_000_000  # max_tokens: refused after the features are stored (context length)


def _smooth_image() -> Image.Image:
    """1024x768, a few tens of KB as PNG (under the shared cluster's --max-image-bytes)."""
    gray = Image.radial_gradient("L").resize((1024, 768))
    return Image.merge("RGB", (gray, gray.transpose(Image.Transpose.FLIP_LEFT_RIGHT), gray.rotate(180)))


def _features_body(cluster) -> tuple[bytes, int]:
    """Render's own answer for a 1024x768 image, its uint8 patches as float32 (4x the bytes); its tokens."""
    rendered = httpx.post(cluster.http_urls("render")[0] + "/v1/chat/completions/render",
                          json=chat("Say.", [_smooth_image()], max_tokens=2), timeout=120).json()
    [b64] = rendered["features"]["kwargs_data"]["image"]
    item = item_from_b64(b64)
    pixels = item["pixel_values"]
    item["pixel_values"] = FieldElem(np.asarray(pixels.data, dtype=np.float32) / 127.5 - 1.0, pixels.field)
    rendered["features"]["kwargs_data"]["image"] = [item_to_b64(item)]
    rendered["sampling_params"] = {"max_tokens": TOO_MANY}
    return json.dumps(rendered).encode(), len(rendered["token_ids"])


def _old_call_s(body: bytes) -> float:
    """The longer of json.loads(body) and the one-call base64 decode of its item (best of two each)."""
    item = json.loads(body)["features"]["kwargs_data"]["image"][0]
    calls = (lambda: json.loads(body), lambda: binascii.a2b_base64(item, strict_mode=True))
    best = [float("inf")] * len(calls)
    for _ in range(2):
        for i, call in enumerate(calls):
            started = time.perf_counter()
            call()
            best[i] = min(best[i], time.perf_counter() - started)
    return max(best)


class Probe(threading.Thread):
    """GET /health back to back (2 ms apart); (sent at, seconds to answer) of each."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.samples, self.stop, self.failures = url, [], threading.Event(), []

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as client:
            while not self.stop.is_set():
                sent = time.perf_counter()
                status = client.get("/health").status_code
                self.samples.append((sent, time.perf_counter() - sent))
                if status != 200:
                    self.failures.append(status)
                time.sleep(0.002)


def _worst_stall(cluster, body: bytes, prompt_tokens: int) -> tuple[float, int, float, float]:
    """(slowest /health answer while the coordinator held the request, probes then, request seconds,
    slowest answer in the quiet 0.4 s before it: the box's own noise, said in the failure message)."""
    gc.collect()
    gc.disable()  # this process's own full collection would read as the coordinator's lag (module docstring)
    try:
        probe = Probe(cluster.url)
        probe.start()
        time.sleep(0.4)
        with cluster.client(timeout=120) as client:
            started = time.perf_counter()
            reply = client.post("/inference/v1/generate", content=body,
                                headers={"Content-Type": "application/json"})
            ended = time.perf_counter()
        probe.stop.set()
        probe.join(timeout=30)
    finally:
        gc.enable()
    assert reply.status_code == 400, reply.text[:300]
    error = reply.json()["error"]
    assert error["code"] == "context_length_exceeded", error
    assert f"However, you requested {prompt_tokens + TOO_MANY} tokens ({prompt_tokens} in the prompt" in \
        error["message"], error
    assert probe.failures == []
    during = [lag for sent, lag in probe.samples if started <= sent <= ended]
    assert len(during) >= 3, (len(during), ended - started)
    quiet = [lag for sent, lag in probe.samples if sent < started - 0.05]
    return max(during), len(during), ended - started, max(quiet, default=float("nan"))


def test_a_20_mb_features_request_barely_stalls_the_coordinators_loop(shm_cluster):
    body, prompt_tokens = _features_body(shm_cluster)
    assert len(body) > 19_000_000, len(body)
    old_s, seen = _old_call_s(body), []
    _worst_stall(shm_cluster, body, prompt_tokens)  # untimed: the first such request's one-time costs (below)
    for _ in range(5):
        seen.append(_worst_stall(shm_cluster, body, prompt_tokens))
        old_s = min(old_s, _old_call_s(body))
        if min(s[0] for s in seen) < 0.5 * old_s:
            break
        time.sleep(1.0)  # a passing burst of load elsewhere on the box
    shown = ", ".join(f"{w * 1e3:.1f} ms of {n} probes in {d:.2f} s (quiet before: {q * 1e3:.1f} ms)"
                      for w, n, d, q in seen)
    assert min(s[0] for s in seen) < 0.5 * old_s, f"worst /health: {shown}; the old path's call {old_s * 1e3:.1f} ms"
