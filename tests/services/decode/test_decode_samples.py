"""n samples of one prompt in the decode engine: one KV load, the prompt's blocks shared, each sample its own.

Each sample must give exactly the tokens a request of its own would (greedy: Hugging Face's; seeded: the
single request seeded with seed + index), which they cannot if a sample read another's K/V or a copy on
write went wrong; and the pool must hold the prompt once, then be whole again when the samples are done.
"""

from __future__ import annotations

import pytest

from services.decode.stream import DecodeEvent
from services.generation.params import DecodeParams

BLOCK = 16


def _open(engine, request_id, pre, firsts, **params):
    """reserve + load + open_samples + start, as the serving core does; the group and its events."""
    p = DecodeParams(**params)
    blocks = engine.reserve(pre.prompt_len, p, samples=len(firsts))
    assert blocks is not None
    group = engine.open_samples(request_id, blocks, pre.prompt_len, pre.rope_delta, firsts, p)
    if not group.finished:
        engine.load(group.blocks, pre.kv, pre.prompt_len)
    engine.start(group)
    return group


def _by_index(events: list[DecodeEvent], n: int) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(n)]
    for event in events:
        out[event.index].extend(event.token_ids)
    return out


def _pool_whole(engine) -> None:
    stats = engine.pool.stats()
    assert (stats.used_blocks, stats.reserved_blocks, stats.tokens_held) == (0, 0, 0)


@pytest.mark.parametrize("which", [0, 1, 2])
def test_greedy_samples_each_give_hugging_faces_tokens(tiny, prefilled, make_engine, which):
    pre = prefilled[which]   # prompt lengths not multiples of the block size: the tail is copied on write
    engine = make_engine(num_slots=4, block_size=BLOCK)
    group = _open(engine, f"g{which}", pre, [pre.first_token] * 3, temperature=0.0, max_tokens=12, ignore_eos=True)
    events = group.stream.collect(timeout=60)
    reference = tiny.reference(pre, 12)
    assert _by_index(events, 3) == [reference] * 3
    assert [e.index for e in events if e.finished] and sum(e.finished for e in events) == 3
    _pool_whole(engine)


def test_seeded_sample_i_is_the_single_request_seeded_with_seed_plus_i(tiny, prefilled, make_engine, submit):
    pre = prefilled[1]
    engine = make_engine(num_slots=8, block_size=BLOCK)
    sampling = {"temperature": 1.0, "max_tokens": 10, "ignore_eos": True}
    group = _open(engine, "seeded", pre, [pre.first_token] * 4, seed=1234, **sampling)
    samples = _by_index(group.stream.collect(timeout=60), 4)
    singles = [submit(engine, f"alone-{i}", pre, seed=1234 + i, **sampling) for i in range(4)]
    assert samples == [s.wait_done(60) and s.token_ids for s in singles]
    assert len({tuple(s) for s in samples}) > 1   # the seeds differ, so the draws do
    _pool_whole(engine)


@pytest.mark.parametrize("partial", [True, False])   # a partial last prompt block (copied on write), or none
def test_the_prompt_is_held_once(tiny, make_engine, partial):
    words = next(n for n in range(370, 400) if bool(len(tiny.chat_ids("word " * n)) % BLOCK) == partial)
    pre = tiny.prefill_text(tiny.chat_ids("word " * words))   # a prompt of many blocks
    engine = make_engine(num_slots=8, block_size=BLOCK)
    group = _open(engine, "held", pre, [pre.first_token] * 8, temperature=0.0, max_tokens=4, ignore_eos=True)
    events = []
    peak = 0
    for event in group.stream:
        events.append(event)
        peak = max(peak, engine.pool.stats().used_blocks)
    assert _by_index(events, 8) == [tiny.reference(pre, 4)] * 8
    prompt_blocks = -(-pre.prompt_len // BLOCK)
    # the prompt once, plus per sample its copy of the partial block and the blocks of its 3 more tokens
    per_sample = -(-(pre.prompt_len % BLOCK + 3) // BLOCK)
    assert peak <= prompt_blocks + 8 * per_sample
    assert peak < 2 * prompt_blocks
    _pool_whole(engine)


def test_a_sample_ending_on_its_first_token_and_an_abort_free_everything(tiny, prefilled, make_engine):
    pre = prefilled[2]
    eos = tiny.lm.eos_token_ids[0]
    engine = make_engine(num_slots=4, block_size=BLOCK)
    group = _open(engine, "mixed", pre, [eos, pre.first_token, pre.first_token], temperature=0.0, max_tokens=50)
    first = group.stream.get(timeout=30)
    assert (first.index, first.finish_reason) == (0, "stop")   # sample 0 ended on its first token
    assert engine.abort("mixed")
    finals = [e for e in group.stream.collect(timeout=30) if e.finished]
    assert sorted(e.index for e in finals) == [1, 2] and {e.finish_reason for e in finals} <= {"abort", "length"}
    _pool_whole(engine)


def test_n_larger_than_the_engine_holds_is_refused(tiny, prefilled, make_engine):
    from services.decode.errors import EngineFull

    pre = prefilled[0]
    engine = make_engine(num_slots=2, max_queued=1, block_size=BLOCK)
    blocks = engine.reserve(pre.prompt_len, DecodeParams(max_tokens=4), samples=4)
    with pytest.raises(EngineFull):
        engine.open_samples("big", blocks, pre.prompt_len, pre.rope_delta, [pre.first_token] * 4,
                            DecodeParams(max_tokens=4))
    _pool_whole(engine)
