"""epd's render writes what the real vLLM's render wrote for the same requests (golden vectors).

tests/data/vllm/render_qwen2_vl.json holds vLLM 0.32's /v1/chat/completions/render answers on the
head_dim-32 Qwen2-VL checkpoint (regenerate: `python scripts/gen_vllm_golden.py`).  That checkpoint
shares the demo's tokenizer, chat template and image processor, so epd's render of the demo must give
the same token ids, placeholders and kwargs_data / mm_metadata bytes; mm_hashes are vLLM's hash of the
same PNG bytes and the model id vLLM was given.  Items too large to store whole are compared by the
SHA-256 of their base64 text.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from services.protocol.items import FieldElem, FieldSpec
from services.protocol.openai import ChatCompletionRequest
from services.protocol.serialization import item_from_b64, item_to_b64
from services.render.hashing import mm_hash
from services.render.serving import RenderService

GOLDEN = json.loads((Path(__file__).parents[2] / "data" / "vllm" / "render_qwen2_vl.json").read_text())
IMAGE_CASES = [name for name, case in GOLDEN["cases"].items() if case["answer"]["features"]]


@pytest.fixture(scope="module")
def service(demo_model_path):
    svc = RenderService(demo_model_path, "epd-demo-qwen2-vl")
    yield svc
    svc.close()


def _request(name: str) -> dict:
    body = copy.deepcopy(GOLDEN["cases"][name]["request"])
    for message in body["messages"]:
        for part in message["content"] if isinstance(message["content"], list) else []:
            if part["type"] == "image_url":
                key = part["image_url"]["url"].removeprefix("image:")
                part["image_url"]["url"] = "data:image/png;base64," + GOLDEN["images"][key]
    return body


def _render(service, name):
    prompt = asyncio.run(service.render_chat(ChatCompletionRequest.model_validate(_request(name))))
    return prompt, prompt.to_generate_request().model_dump(mode="json")


def _same_item(ours: str, theirs: str | dict) -> bool:
    if isinstance(theirs, dict):
        return hashlib.sha256(ours.encode()).hexdigest() == theirs["sha256"]
    return ours == theirs


def _without_slices(b64: str) -> str:
    """The item with its flat fields' slices emptied: vLLM's slices are not the item's own (see below)."""
    item = item_from_b64(b64)
    plain = {k: FieldElem(e.data, FieldSpec.flat([], e.field.dim, e.field.keep_on_cpu) if e.field.kind == "flat"
                          else e.field) for k, e in item.items()}
    return item_to_b64(plain)


@pytest.mark.parametrize("name", sorted(GOLDEN["cases"]))
def test_token_ids_and_placeholders_are_vllms(service, name):
    theirs = GOLDEN["cases"][name]["answer"]
    _, ours = _render(service, name)
    assert ours["token_ids"] == theirs["token_ids"]
    if theirs["features"]:
        assert ours["features"]["mm_placeholders"] == theirs["features"]["mm_placeholders"]


@pytest.mark.parametrize("name", [n for n in IMAGE_CASES if n != "multi_turn"])
def test_kwargs_data_and_mm_metadata_bytes_are_vllms(service, name):
    theirs = GOLDEN["cases"][name]["answer"]["features"]
    _, ours = _render(service, name)
    for mine, golden in zip(ours["features"]["kwargs_data"]["image"], theirs["kwargs_data"]["image"], strict=True):
        assert _same_item(mine, golden)
    assert ours["features"]["mm_metadata"] == theirs["mm_metadata"]


def test_vllms_slices_follow_its_processor_cache_not_the_request(service):
    # multi_turn's one image was rendered before inside two_small's two-image batch: vLLM's item still
    # carries that batch's slices ([0, 16), [16, 48)).  The slices are not part of the item's meaning
    # (its data is its own rows; vLLM's generate side ignores them), so epd writes the request's own
    # and everything else is byte-identical.
    golden = GOLDEN["cases"]["multi_turn"]["answer"]["features"]
    assert item_from_b64(golden["kwargs_data"]["image"][0])["pixel_values"].field.slices == [
        ((0, 16, None),), ((16, 48, None),)]
    _, ours = _render(service, "multi_turn")
    [mine] = ours["features"]["kwargs_data"]["image"]
    assert item_from_b64(mine)["pixel_values"].field.slices == [((0, 16, None),)]
    assert _without_slices(mine) == _without_slices(golden["kwargs_data"]["image"][0])
    assert ours["features"]["mm_metadata"] == golden["mm_metadata"]


@pytest.mark.parametrize("name", IMAGE_CASES)
def test_mm_hashes_are_vllms_for_the_model_id_vllm_was_given(service, name):
    prompt, _ = _render(service, name)
    request = GOLDEN["cases"][name]["request"]
    keys = [part["image_url"]["url"].removeprefix("image:") for message in request["messages"]
            if isinstance(message["content"], list) for part in message["content"] if part["type"] == "image_url"]
    hashes = [mm_hash("image", base64.b64decode(GOLDEN["images"][k]), GOLDEN["model_id"]) for k in keys]
    assert hashes == GOLDEN["cases"][name]["answer"]["features"]["mm_hashes"]["image"]
    # epd hashes with the model as it was given (its path), exactly like vLLM
    assert prompt.mm_hashes == [mm_hash("image", base64.b64decode(GOLDEN["images"][k]), str(service.model_path))
                                for k in keys]


def test_epd_reads_vllms_items(service):
    theirs = GOLDEN["cases"]["two_small"]["answer"]["features"]
    prompt, _ = _render(service, "two_small")
    for golden, item in zip(theirs["kwargs_data"]["image"], prompt.items, strict=True):
        decoded = item_from_b64(golden)
        assert list(decoded) == ["image_grid_thw", "pixel_values"]
        assert decoded["pixel_values"].data.dtype == np.uint8
        assert decoded["pixel_values"].field.slices == [((0, 16, None),), ((16, 48, None),)]
        for key, elem in item.kwargs_item.items():
            assert np.array_equal(decoded[key].data, elem.data)


def test_sampling_params_carry_every_key_vllm_writes(service):
    theirs = GOLDEN["cases"]["text"]["answer"]
    _, ours = _render(service, "text")
    # the rest of the context, explicitly: vLLM ran with --max-model-len 4096
    assert theirs["sampling_params"]["max_tokens"] == 4096 - len(theirs["token_ids"])
    assert ours["sampling_params"]["max_tokens"] == service.max_model_len - len(ours["token_ids"])
    same = {k: v for k, v in theirs["sampling_params"].items() if k != "max_tokens"}
    assert {k: ours["sampling_params"][k] for k in same} == same
    assert set(theirs) <= set(ours) | {"token_offsets"}
