"""Items render builds: field settings, sizes on the wire, per-image arrays, placeholder runs."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from services.models.qwen2_vl import QWEN_VL_METADATA_KEYS
from services.protocol.errors import InvalidRequest
from services.protocol.generate import GenerateRequest
from services.protocol.serialization import encode_item, item_from_b64, item_to_b64
from services.render.features import build_item, rendered_item, to_features
from services.render.placeholders import Expansion, VisionTokens, find_runs, fit_runs
from services.render.processor import ImageProcessor

GOLDEN_GRID_B64 = ("ga5pbWFnZV9ncmlkX3Rod4KkZGF0YZOlaW50NjSRA8cYAwEAAAAAAAAABAAAAAAAAAAEAAAAAAAAAKVmaWVs"
                   "ZJKnYmF0Y2hlZIGra2VlcF9vbl9jcHXD")
V = VisionTokens(start_id=7, pad_id=8, end_id=9)


def noise(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


@pytest.fixture(scope="module")
def processor(demo_model_path) -> ImageProcessor:
    return ImageProcessor(demo_model_path)


@pytest.fixture(scope="module")
def item_448(processor):
    processed = processor.process(noise(448, 448))
    return rendered_item("image", "h", 0, processed.num_tokens, processed.arrays, QWEN_VL_METADATA_KEYS)


@pytest.mark.parametrize(("size", "tokens"), [((448, 448), 256), ((224, 224), 64), ((300, 200), 77),
                                              ((56, 56), 4)])
def test_placeholder_count_per_size(processor, size, tokens) -> None:
    processed = processor.process(noise(*size))
    t, h, w = processed.arrays["image_grid_thw"].tolist()
    assert processed.num_tokens == tokens == t * h * w // 4
    assert processed.arrays["pixel_values"].shape == (t * h * w, 1176)


def test_kwargs_item_fields_follow_vllm_qwen2_vl(item_448) -> None:
    kwargs = item_448.kwargs_item
    assert list(kwargs) == ["image_grid_thw", "pixel_values"]  # vLLM's key order
    pixels, grid = kwargs["pixel_values"], kwargs["image_grid_thw"]
    assert pixels.field.kind == "flat" and pixels.field.slices == [((0, 1024, None),)] and pixels.field.dim == 0
    assert not pixels.field.keep_on_cpu
    assert pixels.data.dtype == np.uint8 and pixels.data.shape == (1024, 1176)  # raw: normalised at encode
    assert grid.field.kind == "batched" and grid.field.keep_on_cpu
    assert grid.data.dtype == np.int64 and grid.data.tolist() == [1, 32, 32]


def test_metadata_item_is_only_the_grid_and_tiny(item_448) -> None:
    assert list(item_448.metadata_item) == ["image_grid_thw"]
    assert len(encode_item(item_448.metadata_item)) < 100
    assert len(encode_item(item_448.kwargs_item)) > 1_000_000


def test_metadata_matches_the_protocol_golden_vector() -> None:
    item = build_item({"pixel_values": np.zeros((64, 1176), np.float32),
                       "image_grid_thw": np.array([1, 4, 4], np.int64)})
    metadata = rendered_item("image", "h", 0, 4, {"image_grid_thw": np.array([1, 4, 4])}, ("image_grid_thw",))
    assert item_to_b64(metadata.metadata_item) == GOLDEN_GRID_B64
    assert item_to_b64({"image_grid_thw": item["image_grid_thw"]}) == GOLDEN_GRID_B64


def test_items_round_trip_through_base64(item_448) -> None:
    back = item_from_b64(item_to_b64(item_448.kwargs_item))
    assert list(back) == list(item_448.kwargs_item)
    for key, elem in item_448.kwargs_item.items():
        assert np.array_equal(back[key].data, elem.data) and back[key].field == elem.field


def test_uint8_patches_normalised_at_encode_equal_the_hf_processor_when_no_resize_is_needed(
        processor, demo_model_path) -> None:
    # 448x448 and 224x56 need no resize, so the HF PIL processor sees the same pixels: same patch layout.
    import torch

    from services.models.input_norm import NormParams, normalize_pixels

    images = [noise(448, 448, 1), noise(224, 56, 2)]
    batched = processor.hf(images=images, return_tensors="np")
    singles = [processor.process(image).arrays for image in images]
    params = NormParams.from_checkpoint(demo_model_path)
    ours = torch.cat([normalize_pixels(torch.from_numpy(s["pixel_values"]), params) for s in singles])
    assert np.allclose(ours.numpy(), batched["pixel_values"], atol=2e-6, rtol=0)
    assert np.array_equal(np.stack([s["image_grid_thw"] for s in singles]), batched["image_grid_thw"])


def test_a_request_gives_every_item_the_slices_of_all_its_items_as_vllm_does(processor) -> None:
    ready = [processor.process(noise(300, 200, 1)), processor.process(noise(128, 128, 2))]
    first = rendered_item("image", "a", 15, ready[0].num_tokens, ready[0].arrays, QWEN_VL_METADATA_KEYS)
    second = rendered_item("image", "b", 94, ready[1].num_tokens, ready[1].arrays, QWEN_VL_METADATA_KEYS)
    features = to_features([first, second])
    wire = [item_from_b64(b) for b in features.kwargs_data["image"]]
    for item, rows in zip(wire, (308, 100), strict=True):
        assert item["pixel_values"].field.slices == [((0, 308, None),), ((308, 408, None),)]
        assert item["pixel_values"].data.shape == (rows, 1176)
    assert first.kwargs_item["pixel_values"].field.slices == [((0, 308, None),)]  # stored item unchanged


def test_to_features_groups_in_prompt_order_and_validates() -> None:
    grid = {"image_grid_thw": np.array([1, 4, 4], np.int64)}
    second = rendered_item("image", "b", 10, 4, grid, QWEN_VL_METADATA_KEYS)
    first = rendered_item("image", "a", 1, 4, grid, QWEN_VL_METADATA_KEYS)
    features = to_features([second, first])
    assert features.mm_hashes == {"image": ["a", "b"]}
    assert [p.offset for p in features.mm_placeholders["image"]] == [1, 10]
    assert features.mm_metadata["image"] == [GOLDEN_GRID_B64, GOLDEN_GRID_B64]
    GenerateRequest(token_ids=list(range(20)), features=features)
    assert to_features([]) is None
    assert to_features([first], include_kwargs=False).kwargs_data is None


def _pads(counts: list[int]) -> list[Expansion]:
    return [Expansion.pads("image", V.pad_id, count) for count in counts]


def test_fit_runs_expands_single_pads_and_keeps_exact_runs() -> None:
    ids = [1, 7, 8, 9, 2, 7, 8, 8, 8, 9, 3]
    out, runs = fit_runs(ids, V, _pads([4, 3]))
    assert out == [1, 7, 8, 8, 8, 8, 9, 2, 7, 8, 8, 8, 9, 3]
    assert [(r.offset, r.length) for r in runs] == [(2, 4), (9, 3)]
    assert fit_runs(out, V, _pads([4, 3])) == (out, runs)  # idempotent


@pytest.mark.parametrize(("ids", "counts", "words"), [
    ([7, 8, 8, 9], [3], "expected 1 or 3"),
    ([7, 8, 9], [], "1 image placeholders but 0 images"),
    ([1, 2], [4], "0 image placeholders but 1 images"),
    ([1, 8, 9], [4], "not enclosed"),
    ([7, 8, 8], [4], "not enclosed"),
])
def test_fit_runs_refuses_bad_runs(ids, counts, words) -> None:
    with pytest.raises(InvalidRequest, match=words):
        fit_runs(ids, V, _pads(counts))


def test_find_runs_on_text_only() -> None:
    assert find_runs([1, 2, 3], V) == []
