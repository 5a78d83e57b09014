"""Render's video path: frame sampling and sizes as vLLM and transformers compute them, placeholders,
and every bad video answered with a 400 naming the problem (the service keeps serving).

What vLLM itself renders for the same videos is compared in tests/interop (a real vLLM 0.32)."""

from __future__ import annotations

import asyncio
import io
import math

import numpy as np
import pytest
import torch

from services.models.tiny import tiny_model_path
from services.protocol.errors import InvalidRequest
from services.protocol.openai import ChatCompletionRequest
from services.render.limits import RenderLimits
from services.render.qwen_video import QwenVideoSettings, resized_size
from services.render.serving import RenderService
from services.render.video_decode import SourceInfo
from services.render.video_sampling import arange_indices, qwen2_indices, qwen3_indices
from tests.support.videos import clip, video_part


def test_arange_indices_equal_torchs_float32_arange():
    """The frame indices of vLLM's Qwen2-VL loader (torch.arange(0, total, total / n).int(), clamped), for
    every clip length up to 1,200 frames and the counts it can ask for."""
    checked = 0
    for total in range(2, 1200):
        for count in sorted({2, 4, 6, 16, 64, 128, 450, 768, total - total % 2} - {0}):
            if count > total:
                continue
            want = torch.clamp(torch.arange(0, total, total / count).int(), max=total - 1).tolist()
            assert arange_indices(total, count) == want, (total, count)
            checked += 1
    assert checked > 9_000


def _source(total: int, fps: float) -> SourceInfo:
    return SourceInfo(total, fps, 224, 224, "h264")


def test_qwen2_sampling_is_vllms():
    """2 frames per second, at least 4, a multiple of the temporal patch; the tail clamped (451 frames)."""
    assert qwen2_indices(_source(16, 4.0), 2) == [0, 2, 4, 6, 8, 10, 12, 14]
    assert qwen2_indices(_source(13, 5.0), 2) == [0, 3, 6, 9]            # 5.2 frames -> 4 (a multiple of 2)
    assert qwen2_indices(_source(8, 2.0), 2) == list(range(8))          # every frame of a 2 fps clip
    # 17 frames at 2.3 fps: 14 asked for, torch's float32 arange gives 15, the last (17) clamped to 16
    assert qwen2_indices(_source(17, 2.3), 2) == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16]
    with pytest.raises(InvalidRequest, match="no known frame rate"):
        qwen2_indices(_source(16, 0.0), 2)


def test_qwen3_sampling_is_vllms():
    assert qwen3_indices(_source(16, 4.0)) == [0, 2, 4, 6, 9, 11, 13, 15]
    assert qwen3_indices(_source(13, 5.0)) == [0, 3, 6, 9, 12]
    assert qwen3_indices(_source(30, 0.0)) == np.linspace(0, 29, 4).round().astype(int).tolist()  # 24 fps assumed


def test_frame_sizes_are_the_video_processors():
    # the video processor's own smart_resize is a copy of the image processor's (its module needs torchvision)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as qwen2_resize
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as qwen3_resize

    qwen2 = QwenVideoSettings.from_checkpoint(tiny_model_path("qwen2_vl"), "qwen2_vl")
    qwen3 = QwenVideoSettings.from_checkpoint(tiny_model_path("qwen3_vl"), "qwen3_vl")
    assert qwen2 is not None and qwen3 is not None and qwen3.processor_class == "Qwen3VLVideoProcessor"
    for frames, height, width in ((8, 224, 224), (4, 200, 300), (5, 31, 700), (64, 1080, 1920), (2, 17, 17)):
        assert resized_size(frames, height, width, qwen2) == qwen2_resize(
            height, width, factor=28, min_pixels=qwen2.min_pixels, max_pixels=qwen2.max_pixels)
        assert resized_size(frames, height, width, qwen3) == qwen3_resize(
            frames, height, width, 2, 32, qwen3.min_pixels, qwen3.max_pixels)


@pytest.fixture(scope="module")
def services():
    limits = RenderLimits(max_video_frame_pixels=300_000, max_video_duration_s=15, max_video_frames=16,
                          max_video_bytes=2_000_000, max_videos_per_request=2)
    made = {family: RenderService(tiny_model_path(family), "m", limits=limits) for family in ("qwen2_vl", "qwen3_vl")}
    yield made
    for service in made.values():
        service.close()


def _chat(*parts, text: str = "What happens?") -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]})


def _render(service, *parts):
    return asyncio.run(service.render_chat(_chat(*parts)))


def test_a_video_becomes_one_item_with_its_pads(services):
    rendered = _render(services["qwen2_vl"], video_part(clip(8, fps=2.0)))
    [item] = rendered.items
    assert item.modality == "video" and item.length == 4 * 8 * 8   # 4 frame groups of 8x8 merged patches
    assert rendered.token_ids[item.offset - 1:item.offset + item.length + 1] == [151652] + [151656] * 256 + [151653]
    assert list(item.kwargs_item) == ["video_grid_thw", "pixel_values_videos"]
    assert list(item.metadata_item) == ["video_grid_thw"]


def test_a_qwen3_video_spells_its_frame_timestamps(services):
    service = services["qwen3_vl"]
    rendered = _render(service, video_part(clip(8, fps=2.0)))
    [item] = rendered.items
    text = service.tokenizer.decode(rendered.token_ids[item.offset:item.offset + item.length])
    pads = "<|video_pad|>" * 49
    assert text == "".join(f"<{t} seconds><|vision_start|>{pads}<|vision_end|>" for t in ("0.2", "1.2", "2.2", "3.2"))
    assert item.kwargs_item["timestamps"].data == [0.25, 1.25, 2.25, 3.25]
    assert list(item.metadata_item) == ["timestamps", "video_grid_thw"]


def test_images_and_videos_keep_prompt_order(services):
    from tests.support.images import data_url, noise_image

    image = {"type": "image_url", "image_url": {"url": data_url(noise_image(64, 64, 1))}}
    rendered = _render(services["qwen2_vl"], video_part(clip(4, 64, 64, fps=2.0)), image,
                       video_part(clip(4, 96, 64, fps=2.0)))
    assert [i.modality for i in rendered.items] == ["video", "image", "video"]
    assert [i.offset for i in rendered.items] == sorted(i.offset for i in rendered.items)


def _zero_frame_avi() -> bytes:
    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="avi") as out:
        stream = out.add_stream("mpeg4", rate=2)
        stream.width, stream.height, stream.pix_fmt = 64, 64, "yuv420p"
        out.start_encoding()
    return buffer.getvalue()


def _unknown_codec() -> bytes:
    return clip(4, 64, 64, fps=2.0, codec="ffv1", options={}, container="avi").replace(b"FFV1", b"ZZZZ")


GOOD = clip(8, fps=2.0)
BAD = {
    "not a video": (b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 8, "invalid_video", "cannot be read"),
    "truncated": (GOOD[:len(GOOD) // 2], "invalid_video", "cannot be read"),
    "zero frames": (_zero_frame_avi(), "invalid_video", "video has no frames"),
    "unknown codec": (_unknown_codec(), "unsupported_video", "codec is not supported"),
    "other container": (b"FLV\x01\x01" + bytes(64), "unsupported_video", "supported containers"),
    "one frame": (clip(1, 64, 64, fps=2.0), "invalid_video", "the model needs at least 2"),
    "frame pixels": (clip(4, 640, 480, fps=2.0), "video_too_large", "max_video_frame_pixels=300000"),
    "duration": (clip(40, 64, 64, fps=2.0), "video_too_long", "max_video_duration_s=15"),
    "frames after sampling": (clip(36, 64, 64, fps=4.0), "video_too_long", "max_video_frames=16"),
    "bytes": (clip(12, 640, 480, fps=2.0, options={"g": "1", "qp": "0"}), "media_too_large", "max_video_bytes"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_video_is_a_400_naming_the_problem(services, case):
    data, code, words = BAD[case]
    with pytest.raises(InvalidRequest, match=words) as caught:
        _render(services["qwen2_vl"], video_part(data))
    assert caught.value.code == code and caught.value.message.startswith("video 0: ")
    assert _render(services["qwen2_vl"], video_part(GOOD)).items   # and the service carries on


def test_too_many_videos_is_refused_before_any_fetch(services):
    with pytest.raises(InvalidRequest, match="max_videos_per_request=2") as caught:
        _render(services["qwen2_vl"], *[video_part(GOOD)] * 3)
    assert caught.value.code == "too_many_videos"


def test_a_decode_past_its_deadline_is_a_400():
    service = RenderService(tiny_model_path("qwen2_vl"), "m", limits=RenderLimits(video_decode_timeout_s=0.01))
    try:
        with pytest.raises(InvalidRequest, match="video_decode_timeout_s=0.01") as caught:
            _render(service, video_part(clip(60, 448, 448, fps=2.0)))
        assert caught.value.code == "video_decode_timeout"
    finally:
        service.close()


def test_content_parts_take_videos(services):
    service = services["qwen2_vl"]
    ids = service.tokenizer.encode("<|vision_start|><|video_pad|><|vision_end|>Describe.")
    rendered = asyncio.run(service.render_content_parts(ids, [{"type": "video_url", "url": video_part(GOOD)
                                                               ["video_url"]["url"]}]))
    assert [i.modality for i in rendered.items] == ["video"] and rendered.items[0].length == 256


def test_a_model_without_video_refuses_it():
    service = RenderService(tiny_model_path("llava"), "m")
    try:
        with pytest.raises(InvalidRequest, match="does not accept videos") as caught:
            _render(service, video_part(GOOD))
        assert caught.value.code == "videos_not_supported"
    finally:
        service.close()


@pytest.mark.parametrize("workers", [0, 1])   # in render's process, and through a worker's shared memory
def test_second_per_grid_ts_is_the_sampled_frames_period(workers):
    service = RenderService(tiny_model_path("qwen2_5_vl"), "m", num_workers=workers)
    try:
        [item] = _render(service, video_part(clip(13, 64, 64, fps=5.0))).items
        seconds = item.kwargs_item["second_per_grid_ts"].data
        assert seconds.dtype == np.float32 and seconds.shape == ()
        assert math.isclose(float(seconds), 2 / (4 / 13 * 5), rel_tol=1e-6)   # 4 of 13 frames at 5 fps
        assert list(item.metadata_item) == ["video_grid_thw", "second_per_grid_ts"]
    finally:
        service.close()


def test_a_qwen3_video_placeholder_marks_its_timestamps_as_no_embedding(services):
    from services.render.answer_format import RenderChatRequest, formatted

    service = services["qwen3_vl"]
    rendered = _render(service, video_part(clip(4, fps=2.0)))
    request = RenderChatRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                "return_is_embed": True})
    body = formatted(rendered.to_generate_request(), request, (151655, 151656))
    [place] = body["features"]["mm_placeholders"]["video"]
    span = body["token_ids"][place["offset"]:place["offset"] + place["length"]]
    assert place["is_embed"] == [t == 151656 for t in span] and sum(place["is_embed"]) == 2 * 49
    assert place["is_embed"][0] is False   # "<" of "<0.2 seconds>"


def test_a_video_url_is_fetched_under_the_image_policy(media_server, media_images, media_net_guard):
    """http(s) videos go through the same SSRF-checked fetch as images: the local server is refused by the default
    policy, and served once private addresses are allowed."""
    from services.render.media_policy import MediaPolicy

    media_images["clip.mp4"] = GOOD   # the session's media server serves this dict by name
    part = {"type": "video_url", "video_url": {"url": media_server.url("/image/clip.mp4")}}
    strict = RenderService(tiny_model_path("qwen2_vl"), "m")
    allowed = RenderService(tiny_model_path("qwen2_vl"), "m", MediaPolicy(allow_private_networks=True))
    try:
        with pytest.raises(InvalidRequest, match="video 0: ") as caught:
            _render(strict, part)
        assert caught.value.code == "media_url_forbidden"
        [item] = _render(allowed, part).items
        assert item.modality == "video" and item.length == 256
    finally:
        strict.close()
        allowed.close()


def test_a_video_longer_than_the_context_is_refused_before_decoding():
    service = RenderService(tiny_model_path("qwen2_vl"), "m", limits=RenderLimits(max_model_len=300))
    try:
        with pytest.raises(InvalidRequest, match="the video alone takes 512 tokens") as caught:
            _render(service, video_part(clip(16, fps=2.0)))   # 8 groups of 64 tokens
        assert caught.value.code == "context_length_exceeded"
        assert _render(service, video_part(clip(4, fps=2.0))).items   # 128 tokens: fits
    finally:
        service.close()
