"""The fused decode step (services/kernels/fused_step.c over panel.c and paged_attention.c), every variant this CPU
runs, against torch: random-weight Llama and Qwen2 decoders (initializer_range 0.1) at the shapes real checkpoints
use (head_dim 64/80/128, GQA groups 1-8, blocks of 16 and 32 tokens), a pool of random KV, rows of odd lengths,
1-64 rows; the reference is the eager paged forward over plain `nn.Linear` layers and torch's attention."""

from __future__ import annotations

import copy

import pytest
import torch

from services.decode.attention import TorchPagedAttention
from services.decode.block_pool import BlockPool
from services.decode.fused import FusedStep
from services.decode.paged_forward import PagedDecoder
from services.models.causal_lm import TextLanguage
from services.models.prepack import prepack_language
from tests.support.kernel_variants import only_variant, runnable

VARIANTS = runnable("fused_step")


@pytest.fixture(autouse=True)
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def language_models(family: str, dim: int, group: int, tmp_path) -> tuple[TextLanguage, TextLanguage]:
    """(torch reference, panel copy) of one random two-layer decoder."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    heads = 8
    shape = dict(hidden_size=256, intermediate_size=352, num_hidden_layers=2, num_attention_heads=heads,
                 num_key_value_heads=heads // group, head_dim=dim, vocab_size=515, initializer_range=0.1,
                 max_position_embeddings=512)
    torch.manual_seed(dim * 10 + group)
    if family == "llama":
        hf = LlamaForCausalLM(LlamaConfig(**shape)).eval()
    else:
        hf = Qwen2ForCausalLM(Qwen2Config(**shape)).eval()
        for layer in hf.model.layers:   # Qwen2's q/k/v biases start at zero: give them values
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.1)
    ref = TextLanguage(hf, hf.model, tmp_path, 512)
    twin = copy.deepcopy(hf)
    panel = TextLanguage(twin, twin.model, tmp_path, 512)
    prepack_language(panel, "panel")
    return ref, panel


def step_inputs(pool: BlockPool, rows: int, seed: int) -> tuple[torch.Tensor, ...]:
    """A random pool and one step of `rows` rows of odd lengths over blocks in random order."""
    gen = torch.Generator().manual_seed(seed)
    block = pool.block_size
    lens = torch.randint(1, 5 * block, (rows,), generator=gen, dtype=torch.int32) | 1
    need = [(int(n) + block - 1) // block for n in lens]
    order = torch.randperm(pool.kv.shape[2] - 1, generator=gen).to(torch.int32) + 1   # block 0 left alone
    tables = torch.zeros(rows, max(need), dtype=torch.int32)
    at = 0
    for row, count in enumerate(need):
        tables[row, :count] = order[at:at + count]
        at += count
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen))
    last = (lens - 1).long()
    write_blocks = tables[torch.arange(rows), last // block].long()
    return (torch.randint(0, 515, (rows,), generator=gen), last, write_blocks, last % block, tables, lens)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("dim", [64, 80, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("block", [16, 32])
@torch.inference_mode()
def test_logits_and_kv_writes_match_torch(monkeypatch, tmp_path, variant, family, dim, group, block):
    with only_variant(monkeypatch, "fused_step", variant):
        ref, panel = language_models(family, dim, group, tmp_path)
        layout = ref.layout
        room = (64 * 5 + 2) * layout.num_layers * 2 * layout.num_kv_heads * block * dim * 4   # 64 rows of <= 5 blocks
        want_pool = BlockPool(layout, room, block_size=block)
        got_pool = BlockPool(panel.layout, room, block_size=block)
        eager = PagedDecoder(ref, want_pool, TorchPagedAttention())
        fused = FusedStep(PagedDecoder(panel, got_pool, TorchPagedAttention()), max_rows=64)
        for rows, threads in ((1, 1), (5, 2), (64, 2)):
            inputs = step_inputs(want_pool, rows, seed=rows + block)
            got_pool.kv.copy_(want_pool.kv)
            torch.set_num_threads(threads)
            want = eager.forward(*inputs)
            got = fused(*inputs)
            assert (got - want).abs().max() <= 2e-5 * want.abs().max(), (rows, threads)
            assert torch.equal(got.argmax(-1), want.argmax(-1))
            assert (got_pool.kv - want_pool.kv).abs().max() <= 2e-5 * want_pool.kv.abs().max()
