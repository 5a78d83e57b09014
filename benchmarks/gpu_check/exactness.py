"""Greedy tokens of epd's CUDA decode step against Hugging Face `generate`, on the same device.

Per family (tiny Qwen2-VL, Qwen2.5-VL, LLaVA: services/models/tiny.py), dtype (float32, bfloat16) and prompt
(text; one image): the full Hugging Face model prefills the prompt into its own cache, epd's decode engine
(services/decode/gpu_runner.py: paged flex attention, CUDA graphs) decodes from that KV and the first token, and
its tokens must equal `generate(do_sample=False)`'s, all of them.  The pixels are the ones the serving side feeds
the tower (tests/support/reference.py).  Through every role, with the real connectors, is the cluster section's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from benchmarks.gpu_check.common import Run

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "llava")
DTYPES = ("float32", "bfloat16")
CASES = {"text": ("Tell me a story about a lighthouse.", None), "image": ("Describe this image.", (448, 448, 1))}
MAX_NEW_TOKENS = 8
MAX_MODEL_LEN = 2048


@dataclass
class Prefilled:
    kv: Any
    prompt_len: int
    rope_delta: int
    first_token: int


def _inputs(processor: Any, text: str, image: tuple[int, int, int] | None, path: Any, device: str) -> Any:
    from tests.support.images import noise_image
    from tests.support.reference import _use_vllm_pixels

    images = [noise_image(*image)] if image else []
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                           tokenize=False)
    inputs = processor(text=[prompt], images=images or None, return_tensors="pt")
    if images:
        _use_vllm_pixels(inputs, processor, images, path)
    return inputs.to(device)


def _prefill(hf: Any, inputs: Any) -> Prefilled:
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config.text_config)
    if hasattr(hf.model, "rope_deltas"):
        hf.model.rope_deltas = None   # a text prompt does not reset the last prompt's
    with torch.inference_mode():
        out = hf(**inputs, cache=cache, use_cache=True)
    kv = torch.stack([torch.stack([layer.keys[0], layer.values[0]])  # type: ignore[union-attr, index]
                      for layer in cache.layers])
    deltas = getattr(hf.model, "rope_deltas", None)
    return Prefilled(kv.clone(), inputs["input_ids"].shape[1], int(deltas.reshape(-1)[0]) if deltas is not None
                     else 0, int(out.logits[0, -1].float().argmax()))


def _generate(hf: Any, inputs: Any, prompt_len: int) -> list[int]:
    import torch

    if hasattr(hf.model, "rope_deltas"):
        hf.model.rope_deltas = None
    with torch.inference_mode():
        out = hf.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW_TOKENS, min_new_tokens=MAX_NEW_TOKENS)
    return out[0, prompt_len:].tolist()


def _decode(engine: Any, pre: Prefilled, request_id: str) -> list[int]:
    from services.generation.params import DecodeParams

    params = DecodeParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    stream = engine.submit(request_id, pre.kv, pre.prompt_len, pre.rope_delta, pre.first_token, params)
    events = stream.collect(timeout=120)
    if events[-1].error:
        raise RuntimeError(f"decode failed: {events[-1].error}")
    return [token for event in events for token in event.token_ids]


def check_family(run: Run, family: str, dtype: str) -> list[dict[str, Any]]:
    import torch
    from transformers import AutoModelForImageTextToText

    from services.decode.engine import DecodeEngine
    from services.models.processing import load_processor, load_tokenizer
    from services.models.registry import adapter_for
    from services.models.tiny import tiny_model_path

    path = tiny_model_path(family)
    processor = load_processor(path)
    hf: Any = AutoModelForImageTextToText.from_pretrained(str(path), dtype=getattr(torch, dtype))
    hf = hf.to(run.device).eval()
    lm = adapter_for(path).load_language(path, run.device, dtype, MAX_MODEL_LEN)   # decode's own copy
    engine = DecodeEngine(lm, load_tokenizer(path), 4, MAX_MODEL_LEN, kv_cache_bytes=64 << 20, graph_buckets=(4,),
                          attention="auto" if run.cuda else "flex", stream_timeout=120)
    rows = []
    try:
        for case, (text, image) in CASES.items():
            inputs = _inputs(processor, text, image, path, run.device)
            pre = _prefill(hf, inputs)
            want = _generate(hf, inputs, pre.prompt_len)
            got = _decode(engine, pre, f"{family}-{dtype}-{case}")
            rows.append({"family": family, "dtype": dtype, "case": case, "identical": got == want, "epd": got,
                         "hf": want, "prompt_len": pre.prompt_len, "step_mode": engine.stats().step_mode})
    finally:
        engine.close()
    return rows


def run(run: Run) -> dict[str, Any]:
    families = ("qwen2_vl",) if run.dry_run else FAMILIES
    dtypes = ("float32",) if run.dry_run else DTYPES
    rows: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    for family in families:
        for dtype in dtypes:
            try:
                rows.extend(check_family(run, family, dtype))
            except Exception as exc:  # noqa: BLE001 - one family's failure is recorded, the others still run
                errors[f"{family}/{dtype}"] = f"{type(exc).__name__}: {exc}"[:2000]
    return {"cases": rows, "identical": sum(r["identical"] for r in rows),
            "total": len(families) * len(dtypes) * len(CASES), "errors": errors}
