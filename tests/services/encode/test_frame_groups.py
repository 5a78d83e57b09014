"""Frame-group embeddings are bit for bit the ones of one whole-video forward, and encode stores and reuses them.

The proof behind the frame-group encoder cache (services/encode/frame_groups.py): for each Qwen-VL family's
tower, loaded and swapped to the kernels encode runs (prepacked linears, the fused RoPE pass), a video's
embeddings (and Qwen3-VL's deepstack features) from one forward over the whole video equal, bit for bit,
those of its frame groups encoded alone, all together, or in a batch beside an image; on two frame sizes
and on 1 and 2 threads.  Then EncodeService over a real shm EC store: an overlapping video encodes only its
new groups, concurrent requests encode a shared group once, and the composite handle prefill reads gives
exactly the whole-video forward's tensors.
"""

from __future__ import annotations

import asyncio
import uuid

import numpy as np
import pytest
import torch

from services.connectors import StoreConfig, create_store
from services.connectors.base import EntryCorrupt
from services.connectors.ec import FrameGroupReader, composite_handle, ec_key
from services.encode.engine import EncodeEngine
from services.encode.serving import EncodeService
from services.protocol.errors import InvalidRequest
from services.protocol.items import FieldElem, FieldSpec

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


@pytest.fixture(scope="module", params=FAMILIES)
def tower(request):
    from services.models.prepack import prepack_vision
    from services.models.registry import adapter_for
    from services.models.tiny import tiny_model_path

    path = tiny_model_path(request.param)
    vision = adapter_for(path).load_vision(path)
    prepack_vision(vision, "auto")
    return vision


def _pixels(vision, groups: int, rows: int, cols: int, seed: int) -> torch.Tensor:
    patch = 16 if type(vision).__name__.startswith("Qwen3") else 14
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(0, 256, (groups * rows * cols, 3 * 2 * patch * patch), dtype=np.uint8))


def _video(pixels: torch.Tensor, groups: int, rows: int, cols: int) -> dict[str, torch.Tensor]:
    return {"pixel_values_videos": pixels, "video_grid_thw": torch.tensor([groups, rows, cols])}


def _forward(vision, items):
    return vision.encode_entries(items)


def _joined(vision, entries):
    return {name: torch.cat([e[name] for e in entries], vision.token_dims.get(name, 0)) for name in entries[0]}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("rows", "cols"), [(16, 16), (12, 22)])
def test_frame_groups_encode_bit_for_bit_as_the_whole_video(tower, threads, rows, cols):
    torch.set_num_threads(threads)
    groups = 4
    pixels = _pixels(tower, groups, rows, cols, seed=rows)
    whole = _forward(tower, [_video(pixels, groups, rows, cols)])[0]
    parts = [_video(pixels[g * rows * cols:(g + 1) * rows * cols], 1, rows, cols) for g in range(groups)]
    alone = _joined(tower, [_forward(tower, [part])[0] for part in parts])
    together = _joined(tower, _forward(tower, parts))
    image = {"pixel_values": pixels[:rows * cols], "image_grid_thw": torch.tensor([1, rows, cols])}
    shuffled_batch = _forward(tower, [image, parts[2], parts[3], parts[0], parts[1]])   # groups out of order
    beside = _joined(tower, [shuffled_batch[i] for i in (3, 4, 1, 2)])
    for name, tensor in whole.items():
        for other in (alone, together, beside):
            assert torch.equal(other[name], tensor), name
    shuffled = _pixels(tower, groups, rows, cols, seed=99)   # negative control: other pixels, other embeddings
    assert not torch.equal(_forward(tower, [_video(shuffled, groups, rows, cols)])[0]["embedding"], whole["embedding"])
    torch.set_num_threads(2)


def _wire(pixels: torch.Tensor, groups: int, rows: int, cols: int) -> dict[str, FieldElem]:
    return {"video_grid_thw": FieldElem(np.array([groups, rows, cols], dtype=np.int64), FieldSpec.batched(True)),
            "pixel_values_videos": FieldElem(pixels.numpy(), FieldSpec.flat([(0, groups * rows * cols, None)]))}


@pytest.fixture
def service(tower):
    store = create_store(StoreConfig("shm", "ec", "t" + uuid.uuid4().hex[:12], capacity_bytes=32 << 20))
    engine = EncodeEngine(tower, max_batch_tokens=100_000)
    yield EncodeService(engine, store, "m", timeout_s=60), FrameGroupReader(store)
    engine.close()
    store.close()


def _read(reader: FrameGroupReader, handle: dict) -> dict[str, torch.Tensor]:
    with reader.view(handle) as tensors:
        return {k: v.clone() for k, v in tensors.items()}


def test_an_overlapping_video_encodes_only_its_new_groups(tower, service):
    encoder, reader = service
    rows = cols = 16
    recording = _pixels(tower, 6, rows, cols, seed=5)   # six groups; videos take four of them
    first, second = recording[:4 * rows * cols], recording[2 * rows * cols:]
    one = asyncio.run(encoder.encode("a", _wire(first, 4, rows, cols)))
    items = encoder.engine.num_items
    two = asyncio.run(encoder.encode("b", _wire(second, 4, rows, cols)))
    assert not one.cache_hit and not two.cache_hit and encoder.engine.num_items - items == 2
    assert two.handle["frame_groups"][:2] == one.handle["frame_groups"][2:]
    for handle, pixels in ((one.handle, first), (two.handle, second)):
        whole = _forward(tower, [_video(pixels, 4, rows, cols)])[0]
        got = _read(reader, handle)
        assert all(torch.equal(got[k], whole[k]) for k in whole)
    again = asyncio.run(encoder.encode("b", None))   # by hash alone: found in the store, group by group
    assert again.cache_hit and again.handle == two.handle and encoder.engine.num_items - items == 2


def test_concurrent_videos_encode_a_shared_group_once(tower, service):
    encoder, _ = service
    rows = cols = 8
    recording = _pixels(tower, 3, rows, cols, seed=6)

    async def both():
        return await asyncio.gather(encoder.encode("x", _wire(recording[:2 * rows * cols], 2, rows, cols)),
                                    encoder.encode("y", _wire(recording[rows * cols:], 2, rows, cols)))

    x, y = asyncio.run(both())
    assert encoder.engine.num_items == 3 and x.handle["frame_groups"][1] == y.handle["frame_groups"][0]


def test_a_video_asked_by_hash_whose_groups_are_gone_needs_its_pixels(tower, service):
    encoder, _ = service
    pixels = _pixels(tower, 2, 8, 8, seed=7)
    done = asyncio.run(encoder.encode("v", _wire(pixels, 2, 8, 8)))
    encoder.store.delete(encoder.videos.get(ec_key(encoder.model_id, "v"))[1])
    with pytest.raises(InvalidRequest, match="no kwargs_data") as caught:
        asyncio.run(encoder.encode("v", None))
    assert caught.value.code == "missing_kwargs_data" and done.handle["frame_groups"]


@pytest.mark.parametrize("handle", [
    {"frame_groups": []},
    {"frame_groups": [{"frame_groups": []}]},
    {"frame_groups": ["x"]},
    {"frame_groups": [{}], "token_dims": {"embedding": -1}},
])
def test_a_malformed_composite_handle_is_refused(handle):
    store = create_store(StoreConfig("shm", "ec", "t" + uuid.uuid4().hex[:12], capacity_bytes=1 << 20))
    try:
        with pytest.raises(EntryCorrupt):
            FrameGroupReader(store).get(handle)
    finally:
        store.close()


def test_groups_that_do_not_fit_together_are_refused():
    store = create_store(StoreConfig("shm", "ec", "t" + uuid.uuid4().hex[:12], capacity_bytes=1 << 20))
    try:
        a = store.put("a", {"embedding": torch.zeros(4, 8)})
        b = store.put("b", {"embedding": torch.zeros(4, 6)})
        with pytest.raises(EntryCorrupt, match="do not fit together"):
            FrameGroupReader(store).get(composite_handle([a, b], {"embedding": 0}))
        assert FrameGroupReader(store).get(composite_handle([a, a], {"embedding": 0}))["embedding"].shape == (8, 8)
    finally:
        store.close()
