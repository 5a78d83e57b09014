"""Bytes prefill receives per image vs the image's kwargs_data, for a 1024x768 image.

One request with one 1024x768 image goes through a cluster; the roles' counters
`epd_encode_mm_bytes_received` (kwargs_data + mm_metadata: what encode gets) and
`epd_prefill_mm_bytes_received` (what prefill gets: mm_metadata only) are read before and
after.  Prefill also receives the item's EC handle (connector JSON, in
ec_transfer_params_json); its size is measured on a real shm-store handle of an embedding
of this image's shape.  Figure: (prefill mm bytes + handle bytes) / encode kwargs bytes.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import urllib.request
import uuid

from benchmarks.common import Figure, print_figures
from benchmarks.procs import Server, attach_epd, metric_sum, running, start_epd

WIDTH, HEIGHT = 1024, 768


def _image_url(width: int, height: int, seed: int) -> str:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def _counters(server: Server) -> dict[str, float]:
    return {"encode": metric_sum(server.metrics("encode"), "epd_encode_mm_bytes_received_total"),
            "prefill": metric_sum(server.metrics("prefill"), "epd_prefill_mm_bytes_received_total")}


def _send(server: Server, model: str) -> dict:
    content = [{"type": "text", "text": "What is in this picture?"},
               {"type": "image_url", "image_url": {"url": _image_url(WIDTH, HEIGHT, uuid.uuid4().int % 10_000)}}]
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    request = urllib.request.Request(server.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as reply:
        return json.loads(reply.read())


def handle_bytes(num_tokens: int, hidden: int) -> int:
    """Size of the JSON EC handle the shm store returns for a [num_tokens, hidden] fp32 embedding."""
    import torch

    from services.connectors import StoreConfig, create_store

    store = create_store(StoreConfig("shm", "ec", f"bench{uuid.uuid4().hex[:8]}", 64 << 20))
    try:
        return len(json.dumps(store.put("x", {"embedding": torch.zeros(num_tokens, hidden)})).encode())
    finally:
        store.close()


def figure_from(server: Server, model: str, hidden: int) -> Figure:
    before = _counters(server)
    answer = _send(server, model)
    after = _counters(server)
    encode_bytes, prefill_bytes = after["encode"] - before["encode"], after["prefill"] - before["prefill"]
    # The handle's size depends on the shape only through its digits: the prompt length bounds the rows.
    handle = handle_bytes(answer["usage"]["prompt_tokens"], hidden)
    value = (prefill_bytes + handle) / encode_bytes if encode_bytes else None
    return Figure(f"bytes prefill receives per image vs kwargs_data ({WIDTH}x{HEIGHT} image)", value, 1 / 1000, "le",
                  detail={"encode_kwargs_bytes": encode_bytes, "prefill_mm_bytes": prefill_bytes,
                          "ec_handle_bytes": handle, "prompt_tokens": answer["usage"]["prompt_tokens"]},
                  note=f"{prefill_bytes:.0f} B mm_metadata + {handle} B EC handle vs {encode_bytes / 1e6:.1f} MB "
                       "kwargs_data to encode")


def run(quick: bool = False, server: Server | None = None) -> list[Figure]:
    from services.models.demo import demo_model_path

    if server is not None:
        return [figure_from(server, server.model_id(), 64)]
    with running(start_epd(str(demo_model_path("tiny")))) as (epd,):
        return [figure_from(epd, epd.model_id(), 64)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--epd-url", help="a running tiny-model cluster")
    args = parser.parse_args(argv)
    print_figures(run(args.quick, attach_epd(args.epd_url) if args.epd_url else None), "payload")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
