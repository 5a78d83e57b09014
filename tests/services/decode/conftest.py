"""Fixtures for the decode engine tests: the tiny demo model, split the way the roles split it.

`tiny.lm` is the LanguageModel decode holds, loaded LM-only through the model
registry's Qwen2-VL adapter with its linears on the panel kernel, as the decode role loads it.  Prefill is done
in-test with the plain HF model and a DynamicCache, and references come from
`model.generate` on that full model, so the engine is checked against Hugging
Face itself.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from services.decode.attention import TorchPagedAttention
from services.decode.block_pool import BlockPool
from services.decode.paged_forward import PagedDecoder
from services.decode.request_blocks import RequestBlocks
from services.decode.stream import DecodeEvent
from services.generation.params import DecodeParams
from services.models.base import LanguageModel

MAX_MODEL_LEN = 512
GREEDY = {"temperature": 0.0}
PROMPTS = ["hi", "Tell me a long story about cats and dogs living together in a small house.",
           "Translate to French: the weather is nice today, let us go for a walk in the park."]


def _language_model(path: Any) -> LanguageModel:
    from services.models.prepack import prepack_language
    from services.models.registry import adapter_for

    lm = adapter_for(path).load_language(path, "cpu", "float32", MAX_MODEL_LEN)
    prepack_language(lm, "panel")   # as the decode role runs it here (auto picks panel); references: plain HF
    return lm


@dataclass
class Prefilled:
    """What prefill hands decode for one prompt."""

    kv: torch.Tensor
    prompt_len: int
    rope_delta: int
    first_token: int
    inputs: dict                 # the generate() inputs, for the reference


class TinyModel:
    def __init__(self) -> None:
        from transformers import Qwen2VLForConditionalGeneration

        from services.models.demo import demo_model_path
        from services.models.processing import load_tokenizer

        self.path = demo_model_path("tiny")
        self.hf = Qwen2VLForConditionalGeneration.from_pretrained(self.path).eval()
        self.tokenizer = load_tokenizer(self.path)
        self.lm = _language_model(self.path)

    def chat_ids(self, text: str) -> list[int]:
        messages = [{"role": "user", "content": text}]
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def prefill_text(self, ids: list[int]) -> Prefilled:
        inputs = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones_like(torch.tensor([ids]))}
        return self._prefill(inputs)

    def prefill_image(self, text: str, image: Any) -> Prefilled:
        from services.models.processing import load_processor

        processor = load_processor(self.path)
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
        prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self._prefill(dict(processor(text=[prompt], images=[image], return_tensors="pt")))

    @torch.inference_mode()
    def _prefill(self, inputs: dict) -> Prefilled:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.hf.config.text_config)
        # The model keeps the last prompt's rope delta, and a text prompt does not reset it.
        self.hf.model.rope_deltas = None
        out = self.hf(**inputs, cache=cache, use_cache=True)
        kv = torch.stack([torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers])
        deltas = self.hf.model.rope_deltas
        rope_delta = int(deltas.reshape(-1)[0]) if deltas is not None else 0
        return Prefilled(kv.clone(), inputs["input_ids"].shape[1], rope_delta,
                         int(out.logits[0, -1].argmax()), inputs)

    @torch.inference_mode()
    def reference(self, prefilled: Prefilled, max_new_tokens: int) -> list[int]:
        self.hf.model.rope_deltas = None
        out = self.hf.generate(**prefilled.inputs, do_sample=False, max_new_tokens=max_new_tokens)
        return out[0, prefilled.prompt_len:].tolist()


class Collector:
    """An on_event sink: the events of one request, and waits on them (each with a deadline)."""

    def __init__(self) -> None:
        self.events: list[DecodeEvent] = []
        self._cond = threading.Condition()

    def __call__(self, event: DecodeEvent) -> None:
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()

    @property
    def token_ids(self) -> list[int]:
        return [t for e in self.events for t in e.token_ids]

    @property
    def final(self) -> DecodeEvent:
        return self.events[-1]

    def wait_tokens(self, count: int, timeout: float = 30.0) -> None:
        with self._cond:
            ok = self._cond.wait_for(lambda: len(self.token_ids) >= count or self._done(), timeout)
        assert ok, f"no {count} tokens within {timeout}s"

    def wait_done(self, timeout: float = 30.0) -> DecodeEvent:
        with self._cond:
            assert self._cond.wait_for(self._done, timeout), f"not finished within {timeout}s"
        return self.final

    def _done(self) -> bool:
        return bool(self.events) and self.events[-1].finished


@torch.inference_mode()
def hf_first_step_logits(tiny: TinyModel, pre: Prefilled) -> torch.Tensor:
    """Hugging Face's logits for the first decode step after `pre` (its KV as the cache): the reference of the
    paged and fused steps' tests."""
    from tests.services.models.helpers import cache_from_kv

    lm = tiny.lm
    position = torch.tensor([pre.prompt_len + pre.rope_delta])
    out = lm.model(inputs_embeds=lm.embed(torch.tensor([[pre.first_token]])), cache=cache_from_kv(pre.kv),
                   position_ids=lm.decode_position_ids(position), use_cache=True)
    return lm.lm_head(out.last_hidden_state[:, -1])[0]


def _submit(engine: Any, request_id: str, pre: Prefilled, **params: Any) -> Collector:
    sink = Collector()
    engine.submit(request_id, pre.kv, pre.prompt_len, pre.rope_delta, pre.first_token,
                  DecodeParams(**params), on_event=sink)
    return sink


@pytest.fixture
def submit():
    """submit(engine, request_id, prefilled, **DecodeParams fields) -> Collector"""
    return _submit


@pytest.fixture(scope="session")
def tiny() -> TinyModel:
    return TinyModel()


@pytest.fixture(scope="session")
def prefilled(tiny) -> list[Prefilled]:
    """PROMPTS prefilled by the HF model (a module may override it with its own prompts)."""
    return [tiny.prefill_text(tiny.chat_ids(p)) for p in PROMPTS]


@pytest.fixture
def make_engine(tiny):
    from services.decode.engine import DecodeEngine

    engines = []

    def make(num_slots: int = 4, max_model_len: int = MAX_MODEL_LEN, **kwargs: Any) -> DecodeEngine:
        engine = DecodeEngine(tiny.lm, tiny.tokenizer, num_slots, max_model_len, **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


class StepBatch:
    """Every prompt's KV loaded into one pool, and the first decode step's inputs for all rows."""

    def __init__(self, tiny, prefilled, position_shift: int = 0, len_shift: int = 0) -> None:
        self.pool = BlockPool(tiny.lm.layout, 32 << 20, block_size=16)
        self.decoder = PagedDecoder(tiny.lm, self.pool, TorchPagedAttention())
        rows = []
        for pre in prefilled:
            assert self.pool.try_reserve(self.pool.blocks_for(pre.prompt_len + 1))
            blocks = RequestBlocks(self.pool, self.pool.blocks_for(pre.prompt_len + 1))
            blocks.load(pre.kv)
            position = blocks.num_tokens
            block, offset, _ = blocks.append_slot()
            rows.append((pre.first_token, position + pre.rope_delta + position_shift, block, offset, blocks))
        width = max(len(r[4].blocks) for r in rows)
        self.tables = torch.zeros((len(rows), width), dtype=torch.int32)
        for index, row in enumerate(rows):
            self.tables[index, :len(row[4].blocks)] = torch.tensor(row[4].blocks, dtype=torch.int32)
        self.inputs = (torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows]),
                       torch.tensor([r[2] for r in rows]), torch.tensor([r[3] for r in rows]), self.tables,
                       torch.tensor([r[4].num_tokens + len_shift for r in rows], dtype=torch.int32))
        self.written = [(r[2], r[3]) for r in rows]

    def new_kv(self) -> torch.Tensor:
        """[rows, layers, 2, Hkv, D]: the K/V this step wrote for each row's new token."""
        return torch.stack([self.pool.kv[:, :, block, :, offset] for block, offset in self.written])
