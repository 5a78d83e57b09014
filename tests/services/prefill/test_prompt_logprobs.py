"""Prompt logprobs computed by prefill: every prompt token's logprob, rank and the top n, equal to Hugging Face's
full forward (log_softmax of row r's logits for token r + 1), also when the prompt runs in chunks, and never
from prefix-cache hits (whose rows are not computed); answered in vLLM's shape."""

from __future__ import annotations

import pytest
import torch

from services.prefill.engine import PrefillEngine
from services.prefill.prompt_logprobs import TokenTexts, answer


@pytest.fixture(scope="module")
def lm(demo_model_path):
    from services.models.registry import adapter_for

    return adapter_for(demo_model_path).load_language(demo_model_path)


@pytest.fixture(scope="module")
def reference(demo_model_path):
    from transformers import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration.from_pretrained(str(demo_model_path)).eval()


def _prompt(length: int) -> list[int]:
    return [(7919 * i + 13) % 150000 for i in range(length)]


def _held(engine: PrefillEngine, ids: list[int], count: int | None):
    held = engine.submit(ids, prompt_logprobs=count).result(60)
    held.release()
    return held


@pytest.mark.parametrize("budget", [2048, 24])   # one forward; chunks of 24 rows
def test_records_equal_the_full_models_and_skip_the_prefix_cache(lm, reference, budget):
    ids = _prompt(70)
    engine = PrefillEngine(lm, max_num_batched_tokens=budget)
    try:
        _held(engine, ids, None)                  # the prompt's blocks are in the prefix cache now
        cached = _held(engine, ids, None)
        assert cached.num_cached_tokens > 0 and cached.prompt_records is None
        held = _held(engine, ids, 3)
        assert held.num_cached_tokens == 0       # every row ran
    finally:
        engine.close()
    with torch.no_grad():
        logprobs = torch.log_softmax(reference(input_ids=torch.tensor([ids])).logits[0].float(), -1)
    records = held.prompt_records
    assert [r.token_id for r in records] == ids[1:]
    for position, record in enumerate(records):
        row, target = logprobs[position], float(logprobs[position][ids[position + 1]])
        assert record.logprob == pytest.approx(target, abs=1e-4)
        assert int((row > target + 1e-4).sum()) < record.rank <= int((row > target - 1e-4).sum())   # 1 + higher
        assert record.top_logprobs == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)


def test_the_answer_has_vllms_shape(demo_model_path, lm):
    engine = PrefillEngine(lm)
    try:
        held = _held(engine, _prompt(5), 2)
    finally:
        engine.close()
    body = answer(held.prompt_records, TokenTexts(demo_model_path))
    assert body[0] is None and len(body) == 5
    for entry, record in zip(body[1:], held.prompt_records, strict=True):
        keys = list(entry)
        assert keys[0] == str(record.token_id)   # the prompt's token first, then the top n (a dict: once each)
        assert set(keys[1:]) <= {str(t) for t in record.top_ids} and len(keys) in (2, 3)
        assert set(entry[keys[0]]) == {"logprob", "rank", "decoded_token"}
        assert isinstance(entry[keys[0]]["decoded_token"], str)
