from __future__ import annotations

import base64
import io
import json
from collections import Counter

import pytest
from PIL import Image

from services.bench.config import BenchError, ImageSize, WorkloadConfig
from services.bench.workloads import make_workload


def _body(request, model="m"):
    return json.loads(request.payload(model))


def _image_urls(body):
    return [p["image_url"]["url"] for p in body["messages"][0]["content"] if p["type"] == "image_url"]


def test_random_mm_is_deterministic_and_well_formed():
    cfg = WorkloadConfig(input_len=40, output_len=12, images_per_request=2, seed=3)
    a, b = make_workload(cfg).build(5), make_workload(cfg).build(5)
    assert a == b
    body = _body(a, "my-model")
    assert body["model"] == "my-model" and body["max_tokens"] == 12 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    text = body["messages"][0]["content"][-1]["text"]
    assert len(text.split()) == 40 == a.est_prompt_tokens
    urls = _image_urls(body)
    assert len(urls) == 2 and urls[0].startswith("data:image/jpeg;base64,")
    image = Image.open(io.BytesIO(base64.b64decode(urls[0].split(",", 1)[1])))
    assert image.size == (224, 224)
    assert make_workload(WorkloadConfig(seed=4)).build(5) != a


def test_image_pool_gives_exactly_n_distinct_images():
    cfg = WorkloadConfig(input_len=4, images_per_request=3, image_pool=7, image_sizes=(ImageSize(32, 32),))
    requests = make_workload(cfg).build_many(0, 20)
    urls = [u for r in requests for u in _image_urls(_body(r))]
    assert len(urls) == 60 and len(set(urls)) == 7
    assert len({i for r in requests for i in r.image_ids}) == 7


def test_no_pool_means_every_image_unique():
    cfg = WorkloadConfig(input_len=4, images_per_request=2, image_sizes=(ImageSize(16, 16),), image_format="png")
    urls = [u for r in make_workload(cfg).build_many(0, 10) for u in _image_urls(_body(r))]
    assert len(set(urls)) == 20 and urls[0].startswith("data:image/png;base64,")


def test_image_size_buckets_follow_their_probabilities():
    sizes = (ImageSize(8, 8, 0.25), ImageSize(16, 12, 0.75))
    workload = make_workload(WorkloadConfig(input_len=1, image_sizes=sizes))
    counts = Counter(workload.images.size_of(k).width for k in range(2000))
    assert 0.21 < counts[8] / 2000 < 0.29


def test_range_ratio_and_text_workload():
    cfg = WorkloadConfig(kind="text", input_len=100, output_len=50, range_ratio=0.5)
    bodies = [_body(r) for r in make_workload(cfg).build_many(0, 50)]
    lengths = [len(b["messages"][0]["content"].split()) for b in bodies]
    assert min(lengths) >= 50 and max(lengths) <= 150 and len(set(lengths)) > 10
    assert all(25 <= b["max_tokens"] <= 75 for b in bodies)
    assert make_workload(cfg).build(0).image_ids == ()


def test_replay_cycles_and_overrides(tmp_path):
    path = tmp_path / "requests.jsonl"
    lines = [{"model": "other", "messages": [{"role": "user", "content": "one two three"}], "max_tokens": 3},
             {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                        {"type": "image_url", "image_url": {"url": "data:x"}}]}]}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    workload = make_workload(WorkloadConfig(kind="replay", replay_file=str(path)))
    first, second, third = workload.build_many(0, 3)
    assert _body(first)["model"] == "m" and _body(first)["max_tokens"] == 3 and _body(first)["stream"] is True
    assert first.est_prompt_tokens == 3 and len(second.image_ids) == 1
    assert third.body == first.body


def test_replay_rejects_bad_files(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "x"}\n')
    with pytest.raises(BenchError, match="'messages'"):
        make_workload(WorkloadConfig(kind="replay", replay_file=str(path)))


def test_endpoint_extra_body_overrides_and_removes_fields():
    request = make_workload(WorkloadConfig(kind="text", input_len=3, output_len=4)).build(0)
    added = json.loads(request.payload("m", {"top_k": 1, "max_tokens": 9}))
    assert added["top_k"] == 1 and added["max_tokens"] == 9 and added["ignore_eos"] is True
    removed = json.loads(request.payload("m", {"ignore_eos": None, "generation_config": "{}"}))
    assert "ignore_eos" not in removed and removed["generation_config"] == "{}" and removed["model"] == "m"


def _clip_frames(url: str) -> list[bytes]:
    import base64
    import io

    import av

    with av.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))) as container:
        return [f.to_ndarray(format="rgb24").tobytes() for f in container.decode(video=0)]


def _video_urls(workload, index):
    body = json.loads(workload.build(index).payload("m"))
    return [p["video_url"]["url"] for p in body["messages"][0]["content"] if p["type"] == "video_url"]


def test_video_clips_overlap_by_whole_frame_groups():
    config = WorkloadConfig(kind="video", video_frames=8, video_size=ImageSize(64, 48), video_overlap=0.5, seed=3)
    workload = make_workload(config)
    first, second = (_clip_frames(_video_urls(workload, i)[0]) for i in (0, 1))
    assert len(first) == len(second) == 8
    assert first[4:] == second[:4] and first[:4] != second[4:]   # half of each clip is the last half of the one before
    assert make_workload(config).build(1).body == workload.build(1).body   # deterministic
    assert workload.build(0).image_ids == ("vid-0",)


def test_video_pool_reuses_clips_and_no_overlap_shares_no_frame():
    pooled = make_workload(WorkloadConfig(kind="video", video_frames=4, video_size=ImageSize(32, 32), video_pool=2))
    assert {_video_urls(pooled, i)[0] for i in range(6)} == {_video_urls(pooled, i)[0] for i in range(2)}
    apart = make_workload(WorkloadConfig(kind="video", video_frames=4, video_size=ImageSize(32, 32)))
    first, second = (_clip_frames(_video_urls(apart, i)[0]) for i in (0, 1))
    assert not set(first) & set(second)
