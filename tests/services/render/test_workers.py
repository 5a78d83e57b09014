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


def _io(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/io", encoding="ascii") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def test_images_and_arrays_cross_by_shared_memory_and_the_buffers_grow(workers, demo_model_path):
    """A 1400x1400 noise PNG (~6 MB) and its ~12 MB of patches outgrow both 4 MB buffers: the arrays still
    equal the in-process processor's, and the workers read and write only a few KB through their sockets."""
    here = ImageProcessor(demo_model_path)
    images = [noise_image(1400, 1400, seed=11), noise_image(300, 200, seed=12), noise_image(1400, 1400, seed=13)]
    datas = [encode(image) for image in images]
    assert len(datas[0]) > 4 << 20
    before = {pid: _io(pid) for pid in workers.worker_pids()}
    for i, (image, data) in enumerate(zip(images, datas, strict=True)):
        there = asyncio.run(workers.process(f"grow-{i}", data))
        expected = here.process(image).arrays
        assert list(there.arrays) == list(expected)
        for key in expected:
            assert np.array_equal(there.arrays[key], expected[key]), (i, key)
    after = {pid: _io(pid) for pid in workers.worker_pids()}
    assert set(after) == set(before)  # the same processes did it
    for pid in after:
        assert after[pid]["rchar"] - before[pid]["rchar"] < 64 << 10, "image bytes went through a pipe"
        assert after[pid]["wchar"] - before[pid]["wchar"] < 64 << 10, "arrays went through a pipe"


def test_a_worker_killed_mid_image_is_a_503_and_a_new_process_takes_its_place(demo_model_path):
    import os
    import signal

    from services.protocol.errors import Unavailable

    pool = ImageWorkers(demo_model_path, None, MediaPolicy(), num_workers=1, cache_bytes=0)
    try:
        pool.warm_up()
        [old] = pool.worker_pids()
        big = encode(noise_image(2800, 2800, seed=3))   # 0.2-1 s in the worker: killed while it works
        [worker] = pool._procs._workers

        async def run():
            task = asyncio.ensure_future(pool.process("big", big))
            for _ in range(5000):   # killed as soon as the job is sent (a fixed sleep raced a fast machine)
                if worker.pending:
                    break
                await asyncio.sleep(0.001)
            assert worker.pending, "the job was never sent"
            os.kill(old, signal.SIGKILL)
            with pytest.raises(Unavailable) as caught:
                await asyncio.wait_for(task, 30)
            return caught.value

        err = asyncio.run(run())
        assert (err.code, err.status) == ("render_worker_died", 503)
        [new] = pool.worker_pids()
        assert new != old
        done = asyncio.run(pool.process("after", encode(noise_image(448, 448, seed=4))))
        assert done.num_tokens == 256
    finally:
        pool.close()


def test_a_caller_that_leaves_mid_image_does_not_take_the_worker_with_it(workers):
    """Cancelled callers: the worker's answer is still read and the worker serves the next images."""
    datas = [encode(noise_image(448, 448, seed=20 + s)) for s in range(6)]

    async def run():
        left = [asyncio.ensure_future(workers.process(f"left-{i}", d)) for i, d in enumerate(datas[:3])]
        await asyncio.sleep(0.005)
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)
        return await asyncio.wait_for(asyncio.gather(*(workers.process(f"next-{i}", d)
                                                       for i, d in enumerate(datas[3:]))), 30)

    assert [p.num_tokens for p in asyncio.run(run())] == [256] * 3
    assert workers._procs.idle() == 2 and not workers._procs._waiting
