"""The CUDA decode step's code, run here on CPU (eager flex, no graphs): exact tokens, exact masks, buckets.

The engine takes the CUDA runner by device (services/decode/runners.py); `attention="flex"` asks for it on CPU.
The model is loaded plain, as the CUDA plan leaves it (no swapped CPU kernels).  What only a GPU can show (the
compiled flex kernel, the graph replays, the host synchronisations) is scripts/gpu_check.sh's.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask

from services.decode.block_pool import BlockPool
from services.decode.flex_paged import PagedMask, _eager, attend
from services.decode.gpu_forward import SLOT, GpuDecoder
from services.decode.gpu_graphs import StepGraphs
from tests.services.decode.conftest import GREEDY, MAX_MODEL_LEN


@pytest.fixture(scope="module")
def plain_lm(tiny):
    from services.models.registry import adapter_for

    return adapter_for(tiny.path).load_language(tiny.path, "cpu", "float32", MAX_MODEL_LEN)


@pytest.fixture
def gpu_engine(tiny, plain_lm):
    from services.decode.engine import DecodeEngine

    engines = []

    def make(num_slots: int = 4, **kwargs):
        engine = DecodeEngine(plain_lm, tiny.tokenizer, num_slots, MAX_MODEL_LEN, attention="flex", **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


def test_greedy_tokens_equal_generate_text_and_image(tiny, gpu_engine, prefilled, submit):
    from tests.support.images import noise_image

    image = tiny.prefill_image("Describe this image.", noise_image(224, 224, 7))
    assert image.rope_delta != 0   # M-RoPE: decode positions are n + rope_delta
    engine = gpu_engine(num_slots=4, block_size=16)
    assert engine.stats().attention_kernel == "flex" and engine.pool.heads_major
    sinks = [submit(engine, f"g{i}", p, max_tokens=20, **GREEDY) for i, p in enumerate([*prefilled, image])]
    for sink, pre in zip(sinks, [*prefilled, image], strict=True):
        sink.wait_done(120)
        assert sink.token_ids == tiny.reference(pre, 20)


def test_sampled_rows_beside_greedy_ones_draw_as_they_do_alone(tiny, gpu_engine, prefilled, submit):
    engine = gpu_engine(num_slots=4, block_size=8)
    sampled = {"temperature": 0.8, "top_k": 20, "seed": 11}
    alone = submit(engine, "alone", prefilled[1], max_tokens=10, **sampled)
    alone.wait_done(120)
    mixed = [submit(engine, "s", prefilled[1], max_tokens=10, **sampled),
             submit(engine, "g", prefilled[0], max_tokens=10, **GREEDY)]
    for sink in mixed:
        sink.wait_done(120)
    assert mixed[0].token_ids == alone.token_ids
    assert mixed[1].token_ids == tiny.reference(prefilled[0], 10)


def _pool_and_rows(seed: int = 0):
    """A pool with random contents and three rows on scattered blocks, one with stale table entries."""
    g = torch.Generator().manual_seed(seed)
    heads, dim, size, blocks = 2, 16, 8, 20
    kv = torch.randn(2, heads, blocks + 1, size, dim, generator=g)
    owned = [[7, 2, 15], [4], [11, 0]]
    lens = [19, 3, 16]   # the last row's last block exactly full
    tables = torch.full((4, 5), 9, dtype=torch.int32)   # 9: stale ids past every row's blocks
    for row, ids in enumerate(owned):
        tables[row, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
    tables[3, 0] = blocks   # a padding row on the scratch block
    meta = torch.tensor([*lens, 1, 3], dtype=torch.int32)   # lens of 4 rows, then the count of real rows
    q = torch.randn(4, 4, dim, generator=g)
    return kv, owned, lens, tables, meta, q, size, blocks


def _dense(kv, ids, length, q, size, scale):
    heads, dim = kv.shape[1], kv.shape[-1]
    keys = kv[0][:, ids].reshape(heads, -1, dim)[:, :length]
    values = kv[1][:, ids].reshape(heads, -1, dim)[:, :length]
    return torch.nn.functional.scaled_dot_product_attention(q[None, :, None], keys[None], values[None], scale=scale,
                                                            enable_gqa=True)[0, :, 0]


def test_the_paged_mask_reads_each_rows_own_blocks_exactly():
    kv, owned, lens, tables, meta, q, size, blocks = _pool_and_rows()
    mask = PagedMask(blocks + 1, size, tables, meta[:-1], meta[-1:], blocks)
    mask.update(4)
    out = attend(_eager, q, kv[0], kv[1], mask.for_rows(4), 0.25)
    for row, ids in enumerate(owned):
        want = _dense(kv, torch.tensor(ids), lens[row], q[row], size, 0.25)
        assert torch.allclose(out[row], want, atol=1e-6, rtol=0), row
    scratch = kv[1][:, blocks, 0]   # the padding row reads its one scratch token: its value, per query head
    assert torch.allclose(out[3], scratch.repeat_interleave(2, dim=0), atol=1e-6)
    assert mask.num_blocks.tolist() == [3, 1, 2, 1]


def test_a_mask_of_the_tail_alone_is_wrong_here_so_the_check_above_can_fail():
    kv, owned, lens, tables, meta, q, size, blocks = _pool_and_rows()
    lens_t = meta[:-1]

    def tail_only(b, h, q_idx, kv_idx):   # the kernel's visited blocks only: eager reads the whole pool
        return kv_idx % size < lens_t[b] - (lens_t[b] - 1) // size * size

    counts = (lens_t + size - 1) // size
    wrong = BlockMask.from_kv_blocks(counts.view(4, 1, 1), tables.view(4, 1, 1, -1), BLOCK_SIZE=(128, size),
                                     mask_mod=tail_only, seq_lengths=(1, (blocks + 1) * size), compute_q_blocks=False)
    out = attend(_eager, q, kv[0], kv[1], wrong, 0.25)
    want = _dense(kv, torch.tensor(owned[0]), lens[0], q[0], size, 0.25)
    assert not torch.allclose(out[0], want, atol=1e-3)


def test_buckets_round_up_and_refuse_beyond_the_largest(plain_lm):
    pool = BlockPool(plain_lm.layout, 1 << 20, 16, heads_major=True)
    graphs = StepGraphs(GpuDecoder(plain_lm, pool, 6, 8), (4, 1, 2, 6))
    assert [graphs.bucket_for(n) for n in range(1, 7)] == [1, 2, 4, 4, 6, 6]
    with pytest.raises(ValueError, match="beyond the largest bucket 6"):
        graphs.bucket_for(7)
    report = graphs.capture(lambda bucket: None)
    assert not graphs.captured and report.mode == "eager" and "CUDA graphs are CUDA's" in report.reason


def test_padding_rows_write_only_the_scratch_block(tiny, plain_lm, prefilled):
    from services.decode.gpu_runner import GpuRunner
    from services.decode.request_blocks import RequestBlocks
    from services.generation.params import DecodeParams
    from services.sampling.sampler import RowSampling, Sampler

    pool = BlockPool(plain_lm.layout, 1 << 20, 8, heads_major=True)
    runner = GpuRunner(plain_lm, pool, 4, MAX_MODEL_LEN, Sampler(0), buckets=(4,))
    seqs = []
    for row, pre in enumerate(prefilled):
        count = pool.blocks_for(pre.prompt_len + 1)
        assert pool.try_reserve(count)
        seqs.append(RequestBlocks(pool, count))
        seqs[-1].load(pre.kv)
        runner.place(row, seqs[-1])
    before = pool.kv.clone()
    rows = [RowSampling(DecodeParams(**GREEDY)) for _ in seqs]
    tokens = runner.step([p.first_token for p in prefilled], [p.rope_delta for p in prefilled], seqs, rows)
    assert len(tokens) == 3 and runner.decoder.buffers.meta[-1].item() == 3
    written = {int(s) for s in runner.decoder.buffers.step64[SLOT, :4]}
    scratch = pool.scratch_block * pool.block_size
    assert written == {seq.blocks[-1] * 8 + (seq.num_tokens - 1) % 8 for seq in seqs} | {scratch}
    changed = (before != pool.kv).any(dim=-1).any(dim=1).any(dim=1).any(dim=0)   # [blocks, tokens] per token
    tokens_changed = {int(b) * 8 + int(t) for b, t in changed.nonzero()}
    assert tokens_changed <= written   # the rows' new K/V, and the padding row's scratch token; nothing else
    for seq in seqs:
        seq.release()
