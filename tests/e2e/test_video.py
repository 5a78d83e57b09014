"""Videos through a real cluster (render -> encode -> prefill -> decode), token for token as `generate`.

One cluster per family (tiny random Qwen2-VL, Qwen2.5-VL and Qwen3-VL checkpoints) and connector (shm,
and Redis started by the test): a video alone, an image and a video in one prompt, and a clip that
overlaps one sent before; greedy tokens through the coordinator must equal `generate` in one process fed
the same processed video (tests/support/reference_video.py).  The overlapping clip must encode only its
new frame groups, and the same frames in another file none (encode's epd_encode_frame_groups_total).

Clips are 2 frames per second, so vLLM's sampling keeps every frame: frame groups are frames (2k, 2k+1).
Qwen2.5-VL's get small (two groups): its tiny tower's 4 tokens per second space the groups' temporal
positions past their spatial ones from the third group on, where transformers 5.x and vLLM position the text
after a video differently (services/models/mrope.py); the reference is transformers.
"""

from __future__ import annotations

import pytest

from tests.support.cluster import metric_value, start_cluster
from tests.support.images import data_url as image_url
from tests.support.images import noise_image
from tests.support.videos import clip, video_part

MAX_TOKENS = 8
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
GROUPS = {"qwen2_vl": 4, "qwen2_5_vl": 2, "qwen3_vl": 4}   # frame groups of a clip (2 frames each)


# Every family on shm; the redis connectors on one (what they move does not depend on the family, and each
# cluster costs the suite ~15 s).  The shm ones are the family clusters test_model_families.py uses too.
CASES = [*((f, "shm") for f in FAMILIES), ("qwen2_5_vl", "redis")]


def family_key(params: dict) -> tuple[str, str] | None:
    """The shared family cluster a test with these parameters uses (tests/support/family_clusters.py)."""
    family, connector = params["served"]
    return (family, "cpu") if connector == "shm" else None


@pytest.fixture(scope="module", params=CASES, ids=lambda p: f"{p[0]}-{p[1]}")
def served(request, family_clusters, stopped_together):
    from services.models.tiny import tiny_model_path
    from tests.support.family_clusters import family_flags
    from tests.support.reference import Reference

    family, connector = request.param
    path = tiny_model_path(family)
    key = family_key({"served": request.param})
    if key is not None:
        yield family, family_clusters.cluster(__name__, key), Reference(path)
        family_clusters.release(__name__, key)
        return
    redis = request.getfixturevalue("redis_server")
    flags = [*family_flags((family, "cpu")), "--ec-connector", "redis", "--kv-connector", "redis",
             "--redis-url", redis.url]
    cluster = start_cluster(*flags, timeout=600)   # a loaded 2-core machine: the first start compiles decode
    yield family, cluster, Reference(path)
    cluster.terminate()
    stopped_together.append(cluster)


def _ask(cluster, parts):
    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True}
    with cluster.client() as client:
        reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["token_ids"]


def _groups(cluster) -> dict[str, float]:
    text = cluster.metrics("encode")
    return {r: metric_value(text, "epd_encode_frame_groups_total", f'result="{r}"') for r in ("cache_hit", "encoded")}


def _check(served, parts, reference_parts):
    from tests.support.reference_video import greedy_parts

    _, cluster, reference = served
    got = _ask(cluster, parts)
    want = greedy_parts(reference, reference_parts, MAX_TOKENS)
    assert got == want and len(want) == MAX_TOKENS


def _clip(family: str, recording: int, start_group: int = 0) -> bytes:
    return clip(2 * GROUPS[family], fps=2.0, recording=recording, start=2 * start_group)


def test_a_video_alone(served):
    family = served[0]
    data = _clip(family, recording=1)
    _check(served, [video_part(data), {"type": "text", "text": "Describe this video."}],
           [("video", data), ("text", "Describe this video.")])


def test_an_image_and_a_video(served):
    family = served[0]
    data, image = _clip(family, recording=2), noise_image(224, 336, 5)
    parts = [{"type": "image_url", "image_url": {"url": image_url(image)}}, video_part(data),
             {"type": "text", "text": "Compare them."}]
    _check(served, parts, [("image", image), ("video", data), ("text", "Compare them.")])


def test_an_overlapping_clip_encodes_only_its_new_frame_groups(served):
    family, cluster, _ = served
    groups = GROUPS[family]
    _ask(cluster, [video_part(_clip(family, recording=3)), {"type": "text", "text": "What happens?"}])
    before = _groups(cluster)
    later = _clip(family, recording=3, start_group=groups // 2)   # its first half is the first clip's second
    _check(served, [video_part(later), {"type": "text", "text": "And then?"}],
           [("video", later), ("text", "And then?")])
    after = _groups(cluster)
    assert after["encoded"] - before["encoded"] == groups - groups // 2
    assert after["cache_hit"] - before["cache_hit"] == groups // 2


def test_the_same_frames_in_another_file_encode_nothing(served):
    """Another container holds the same pixels: another mm_hash, but every frame group is found."""
    family, cluster, _ = served
    frames = 2 * GROUPS[family]
    first = clip(frames, fps=2.0, recording=4)
    _ask(cluster, [video_part(first), {"type": "text", "text": "Look."}])
    before = _groups(cluster)
    again = clip(frames, fps=2.0, recording=4, container="matroska")
    assert again != first
    _check(served, [video_part(again, "matroska"), {"type": "text", "text": "Look."}],
           [("video", again), ("text", "Look.")])
    after = _groups(cluster)
    assert (after["encoded"] - before["encoded"], after["cache_hit"] - before["cache_hit"]) == (0, GROUPS[family])


def test_the_render_answer_and_content_parts_give_the_same_tokens(served):
    """vLLM's scale-out paths: render's /v1/chat/completions/render answer posted unchanged to
    /inference/v1/generate, and token ids + a content_parts video_url sent to the same route."""
    family, cluster, reference = served
    data = _clip(family, recording=5)
    parts = [video_part(data), {"type": "text", "text": "Describe."}]
    chat = {"messages": [{"role": "user", "content": parts}], "max_tokens": MAX_TOKENS, "temperature": 0}
    want = _ask(cluster, parts)
    with cluster.client() as client:
        rendered = client.post(cluster.http_urls("render")[0] + "/v1/chat/completions/render", json=chat).json()
        assert list(rendered["features"]["mm_hashes"]) == ["video"]
        by_render = client.post("/inference/v1/generate", json=rendered)
        template = reference.processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Describe."}]}],
            add_generation_prompt=True, tokenize=False)
        ids = reference.tokenizer(template)["input_ids"]
        by_parts = client.post("/inference/v1/generate", json={
            "token_ids": ids, "content_parts": [{"type": "video_url", "url": video_part(data)["video_url"]["url"]}],
            "sampling_params": {"max_tokens": MAX_TOKENS, "temperature": 0}})
    for reply in (by_render, by_parts):
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["token_ids"] == want


def test_bad_videos_are_400s_naming_the_problem_and_the_cluster_serves_on(served):
    family, cluster, _ = served
    data = _clip(family, recording=6)
    cases = {"truncated": (data[:len(data) // 2], "invalid_video"),
             "not a video": (b"RIFF" + bytes(64), "unsupported_video"),
             "one frame": (clip(1, 64, 64, fps=2.0), "invalid_video")}
    for name, (bad, code) in cases.items():
        body = {"messages": [{"role": "user", "content": [video_part(bad), {"type": "text", "text": "?"}]}],
                "max_tokens": 2}
        with cluster.client() as client:
            reply = client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 400, (name, reply.text)
        error = reply.json()["error"]
        assert error["code"] == code and error["message"].startswith("video 0: "), (name, error)
    assert len(_ask(cluster, [video_part(data), {"type": "text", "text": "Still there?"}])) == MAX_TOKENS
