"""Render's worker processes and processed-item cache (services/render/workers.py), with real spawned workers."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from services.protocol.errors import InvalidRequest
from services.render.media_policy import MediaPolicy
from services.render.processor import ImageProcessor
from services.render.workers import CACHE, ImageWorkers, ProcessedCache
from tests.support.images import encode, noise_image


@pytest.fixture(scope="module")
def workers(demo_model_path):
    pool = ImageWorkers(demo_model_path, None, MediaPolicy(), num_workers=2, cache_bytes=64 << 20)
    pool.warm_up()
    yield pool
    pool.close()


def _hits() -> float:
    return CACHE.labels("hit")._value.get()


def test_workers_give_the_arrays_of_the_in_process_processor(workers, demo_model_path):
    image = noise_image(300, 200, seed=5)
    here = ImageProcessor(demo_model_path).process(image)
    there = asyncio.run(workers.process("k-300x200", encode(image)))
    assert there.num_tokens == here.num_tokens and list(there.arrays) == list(here.arrays)
    for key in here.arrays:
        assert np.array_equal(there.arrays[key], here.arrays[key]), key


def test_several_images_at_once_and_a_seen_one_is_not_processed_again(workers):
    datas = [encode(noise_image(448, 448, seed=s)) for s in range(4)]

    async def run():
        return await asyncio.gather(*(workers.process(f"k{i}", d) for i, d in enumerate(datas)))

    first = asyncio.run(run())
    hits = _hits()
    again = asyncio.run(workers.process("k2", b"not even an image: the cache answers by content key"))
    assert _hits() == hits + 1 and again is first[2]
    assert [p.num_tokens for p in first] == [256] * 4  # 448x448: 32 x 32 patches, 2 x 2 merged


def test_a_corrupt_image_is_the_same_400_from_a_worker(workers):
    with pytest.raises(InvalidRequest) as caught:
        asyncio.run(workers.process("bad", b"\x89PNG\r\n\x1a\n garbage"))
    assert caught.value.code == "invalid_image" and caught.value.status == 400


def test_the_cache_is_bounded_in_bytes_least_recently_used_out():
    from services.render.processor import ProcessedImage

    cache = ProcessedCache(max_bytes=3000)
    item = lambda: ProcessedImage({"pixel_values": np.zeros(250, np.float32)}, 1)  # noqa: E731 - 1000 bytes
    for key in "abc":
        cache.put(key, item())
    cache.get("a")
    cache.put("d", item())
    assert (cache.get("b"), len(cache), cache.bytes_used) == (None, 3, 3000)
    assert cache.get("a") is not None and cache.get("d") is not None
