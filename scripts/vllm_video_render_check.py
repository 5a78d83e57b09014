"""vLLM's render against epd's on the interop suite's video cases, with vLLM's lighter render server only.

    python scripts/vllm_video_render_check.py qwen2_vl qwen2_5_vl qwen3_vl

The interop suite (tests/interop/test_vllm_video.py) compares the same renders through `vllm serve` (~4.5 GB, and
also cross-feeds the generates); this runs `vllm launch render --dtype float32` (~1.7 GB, no engine) per family
and epd's RenderService in this process, and prints, per case, whether token ids, mm_hashes, placeholders, and
the decoded mm_metadata and kwargs_data items are equal.  Exit status 1 if any differ.
"""

from __future__ import annotations

import asyncio
import base64
import sys

import httpx
import msgpack

from benchmarks.peers.vllm_checkpoints import checkpoint_path
from benchmarks.peers.vllm_env import start_render
from services.protocol.openai import ChatCompletionRequest
from services.render.serving import RenderService
from tests.interop.test_vllm_video import CASES, MAX_TOKENS


def _maps(lists: dict) -> dict:
    return {m: [msgpack.unpackb(base64.b64decode(r), strict_map_key=False) for r in items]
            for m, items in lists.items()}


def check(family: str) -> bool:
    folder = checkpoint_path(family)
    server = start_render(folder, "--dtype", "float32", timeout_s=1500)
    service = RenderService(folder, folder.name)
    equal = True
    try:
        for case, messages in CASES.items():
            body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
            theirs = httpx.post(server.url + "/v1/chat/completions/render", json=body, timeout=600).json()
            prompt = asyncio.run(service.render_chat(ChatCompletionRequest.model_validate(body), "chatcmpl-x"))
            ours = prompt.to_generate_request().model_dump(mode="json")
            same = {"token_ids": ours["token_ids"] == theirs["token_ids"]}
            same.update({k: ours["features"][k] == theirs["features"][k] for k in ("mm_hashes", "mm_placeholders")})
            same.update({k: _maps(ours["features"][k]) == _maps(theirs["features"][k])
                         for k in ("mm_metadata", "kwargs_data")})
            equal &= all(same.values())
            print(family, case, "equal" if all(same.values()) else same, flush=True)
    finally:
        service.close()
        server.stop()
    return equal


def main(argv: list[str]) -> int:
    results = [check(family) for family in argv or ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]]
    return 0 if all(results) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
