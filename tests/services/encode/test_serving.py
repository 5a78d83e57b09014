"""EncodeService over a real shm EC store: items of many concurrent requests share one vision forward
(far more of them than a thread pool has threads), and an EC put never holds up the next forward."""

from __future__ import annotations

import asyncio
import threading
import uuid

import numpy as np
import pytest
import torch

from services.connectors import StoreConfig, create_store
from services.connectors.wiring import INLINE_BYTES
from services.encode.engine import EncodeEngine
from services.encode.serving import EncodeService
from services.protocol.items import FieldElem, FieldSpec
from tests.services.encode.test_engine import GatedVision, wait_until
from tests.services.models.helpers import picture

NUM_ITEMS = 12  # twice the default thread pool of a 2-core machine (min(32, cpus + 4) = 6)


@pytest.fixture(scope="module")
def vision(demo_model_path):
    from services.models.registry import adapter_for

    return adapter_for(demo_model_path).load_vision(demo_model_path, "cpu", "float32")


@pytest.fixture(scope="module")
def items(demo_model_path):
    """Distinct 224x224 images as wire items (what render sends), with their torch tensors."""
    from services.models.processing import load_image_processor

    image_processor = load_image_processor(demo_model_path)
    out = []
    for seed in range(NUM_ITEMS):
        features = image_processor(images=[picture(224, 224, seed)], return_tensors="pt")
        tensors = {"pixel_values": features["pixel_values"], "image_grid_thw": features["image_grid_thw"][0]}
        wire = {"pixel_values": FieldElem(tensors["pixel_values"].numpy(), FieldSpec.flat([(0, 64, None)])),
                "image_grid_thw": FieldElem(tensors["image_grid_thw"].numpy().astype(np.int64),
                                            FieldSpec.batched(keep_on_cpu=True))}
        out.append((wire, tensors))
    return out


@pytest.fixture
def store():
    ec = create_store(StoreConfig("shm", "ec", "t" + uuid.uuid4().hex[:12], capacity_bytes=16 << 20))
    yield ec
    ec.close()


class GatedPuts:
    """The real store, whose first put waits for `release` (a slow backend, made slow on purpose)."""

    local = False  # a backend that can be slow (Redis): its puts run in a thread, never on the loop

    def __init__(self, inner) -> None:
        self.inner = inner
        self.put_started, self.release = threading.Event(), threading.Event()

    def put(self, key, tensors):
        if not self.put_started.is_set():
            self.put_started.set()
            assert self.release.wait(30)
        return self.inner.put(key, tensors)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_items_of_many_requests_share_one_forward(vision, items, store):
    gated = GatedVision(vision)

    async def main(engine: EncodeEngine) -> list:
        service = EncodeService(engine, store, "m", timeout_s=60)
        first = asyncio.create_task(service.encode("h0", items[0][0]))
        await asyncio.to_thread(gated.started.wait, 30)
        rest = [asyncio.create_task(service.encode(f"h{i}", items[i][0])) for i in range(1, NUM_ITEMS)]
        await asyncio.to_thread(wait_until, lambda: engine.num_pending == NUM_ITEMS - 1)
        gated.release.set()
        return await asyncio.gather(first, *rest)

    with EncodeEngine(gated, max_batch_tokens=100_000) as engine:
        results = asyncio.run(main(engine))
    assert gated.batch_sizes == [1, NUM_ITEMS - 1]
    for result, (_, tensors) in zip(results, items, strict=True):
        assert not result.cache_hit
        torch.testing.assert_close(store.get(result.handle)["embedding"], vision.encode([tensors])[0],
                                   rtol=0, atol=1e-6)


def test_the_next_forward_does_not_wait_for_the_ec_put(vision, items, store):
    puts = GatedPuts(store)

    async def main(engine: EncodeEngine) -> list:
        service = EncodeService(engine, puts, "m", timeout_s=60)
        first = asyncio.create_task(service.encode("h0", items[0][0]))
        await asyncio.to_thread(puts.put_started.wait, 30)  # item 0 is encoded; its put is stuck
        second = await service.encode("h1", items[1][0])    # ... and item 1 still gets its forward and put
        assert engine.num_forwards == 2 and not first.done()
        puts.release.set()
        return [await first, second]

    with EncodeEngine(vision, max_batch_tokens=100_000) as engine:
        results = asyncio.run(main(engine))
    for result, (_, tensors) in zip(results, items[:2], strict=True):
        torch.testing.assert_close(store.get(result.handle)["embedding"], vision.encode([tensors])[0],
                                   rtol=0, atol=1e-6)


class ThreadOfPuts:
    """The real store, noting which thread each put ran on."""

    def __init__(self, inner, local: bool) -> None:
        self.inner, self.local, self.threads = inner, local, []

    def put(self, key, tensors):
        self.threads.append(threading.get_ident())
        return self.inner.put(key, tensors)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("local", [True, False])
def test_a_small_entry_of_a_local_store_is_put_on_the_loop(vision, items, store, local):
    """Two thread wake-ups cost more than copying a small entry: a local store's small put runs on the loop;
    a store that does I/O is never called there."""
    puts = ThreadOfPuts(store, local)

    async def main(engine: EncodeEngine):
        result = await EncodeService(engine, puts, "m", timeout_s=60).encode("h0", items[0][0])
        return result, threading.get_ident()

    with EncodeEngine(vision, max_batch_tokens=100_000) as engine:
        result, loop_thread = asyncio.run(main(engine))
    assert store.stats().bytes_copied <= INLINE_BYTES
    assert (puts.threads == [loop_thread]) is local and len(puts.threads) == 1
    torch.testing.assert_close(store.get(result.handle)["embedding"], vision.encode([items[0][1]])[0],
                               rtol=0, atol=1e-6)


def test_a_caller_that_gives_up_is_not_encoded(vision, items, store):
    gated = GatedVision(vision)

    async def main(engine: EncodeEngine) -> None:
        service = EncodeService(engine, store, "m", timeout_s=0.3)
        with pytest.raises(Exception, match="did not finish"):
            await service.encode("h0", items[0][0])  # held in the gated forward past its deadline
        with pytest.raises(Exception, match="did not finish"):
            await service.encode("h1", items[1][0])  # waits behind it, gives up before its forward

    with EncodeEngine(gated, max_batch_tokens=100_000) as engine:
        asyncio.run(main(engine))
        gated.release.set()
        wait_until(lambda: engine.num_pending == 0)
    assert gated.batch_sizes == [1] and engine.num_items == 1  # item 1 never ran


def test_an_idle_engine_encodes_a_small_item_on_the_loop(vision, items, store):
    """No hand-off to the engine thread and back for a small forward the engine is free to run now; the same
    entry as the engine thread's."""
    from tests.services.encode.test_engine import ThreadNoting

    noting = ThreadNoting(vision)

    async def main(engine: EncodeEngine):
        result = await EncodeService(engine, store, "m", timeout_s=60).encode("h-inline", items[0][0])
        return result, threading.current_thread().name

    with EncodeEngine(noting, max_batch_tokens=100_000) as engine:
        result, loop_thread = asyncio.run(main(engine))
    assert noting.threads == [loop_thread] and engine.num_forwards == 1
    torch.testing.assert_close(store.get(result.handle)["embedding"], vision.encode([items[0][1]])[0],
                               rtol=0, atol=0)


def test_a_request_that_leaves_does_not_cancel_the_encode_others_joined(vision, items, store):
    """Two requests ask for one item: the first (whose call started the encode) is cancelled while the forward
    runs; the second still gets the embedding, from the one forward, and it is stored for later requests."""
    gated = GatedVision(vision)

    async def main(engine: EncodeEngine):
        service = EncodeService(engine, store, "m", timeout_s=30)
        first = asyncio.ensure_future(service.encode("h0", items[0][0]))
        await asyncio.to_thread(gated.started.wait, 10)
        second = asyncio.ensure_future(service.encode("h0", items[0][0]))
        await asyncio.sleep(0.05)
        first.cancel()
        await asyncio.sleep(0.05)
        gated.release.set()
        joined = await second
        with pytest.raises(asyncio.CancelledError):
            await first
        later = await service.encode("h0", items[0][0])
        return joined, later, service.admission.inside

    with EncodeEngine(gated, max_batch_tokens=100_000) as engine:
        joined, later, inside = asyncio.run(main(engine))
    assert not joined.cache_hit and later.cache_hit and later.handle == joined.handle
    assert gated.batch_sizes == [1] and inside == 0
    torch.testing.assert_close(store.get(joined.handle)["embedding"], vision.encode([items[0][1]])[0],
                               rtol=0, atol=1e-6)
