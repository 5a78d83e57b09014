"""RenderService against the real Qwen2-VL processor: token ids, items, limits, every input path."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from PIL import Image

from services.models.processing import load_processor
from services.protocol.errors import InvalidRequest, NotFound
from services.protocol.generate import GenerateRequest
from services.protocol.openai import ChatCompletionRequest, CompletionRequest
from services.protocol.sampling import SamplingParams
from services.protocol.serialization import item_from_b64
from services.render.limits import RenderLimits
from services.render.media_policy import MediaPolicy
from services.render.serving import RenderService
from services.render.uuid_scope import scoped_uuid
from tests.support.pixels import assert_pixels_match

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
MODEL = "epd-demo"
SYSTEM_IDS = [151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645]
HELLO_IDS = SYSTEM_IDS + [198, 151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]
IMAGE_PAD = 151655


def png(width: int, height: int, seed: int = 0) -> tuple[Image.Image, str]:
    """A noise image and its PNG data URL (no network anywhere in these tests)."""
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return image, "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def chat(*parts: object, model: str | None = MODEL, **extra: object) -> ChatCompletionRequest:
    content = [{"type": "image_url", "image_url": {"url": p}} if str(p).startswith("data:") else
               {"type": "text", "text": p} for p in parts]  # type: ignore[union-attr]
    return ChatCompletionRequest.model_validate(
        {"model": model, "messages": [{"role": "user", "content": content}], **extra})


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def service(demo_model_path):
    svc = RenderService(demo_model_path, MODEL, MediaPolicy(),
                        RenderLimits(max_images_per_request=3, max_image_pixels=800 * 800),
                        aliases=("demo-alias",))
    yield svc
    svc.close()


@pytest.fixture(scope="module")
def hf(demo_model_path):
    return load_processor(demo_model_path)


def assert_matches_processor(rendered, hf, images) -> None:
    expected = hf(text=[rendered.prompt], images=images, return_tensors="np")
    assert rendered.token_ids == expected["input_ids"][0].tolist()
    rows = 0
    for item, image in zip(rendered.items, images, strict=True):
        pixels = item.kwargs_item["pixel_values"].data
        assert_pixels_match(pixels, expected["pixel_values"][rows:rows + len(pixels)], image, hf.image_processor)
        rows += len(pixels)
        ids = rendered.token_ids
        assert ids[item.offset:item.offset + item.length] == [IMAGE_PAD] * item.length
        assert ids[item.offset - 1] == 151652 and ids[item.offset + item.length] == 151653
    assert rows == len(expected["pixel_values"])
    grids = np.stack([item.kwargs_item["image_grid_thw"].data for item in rendered.items])
    assert np.array_equal(grids, expected["image_grid_thw"])


# ---- text -----------------------------------------------------------------------------------------

def test_text_chat_equals_qwen2_vl_instruct_ids(service) -> None:
    assert service.template.encode("<|im_start|>system\nYou are a helpful assistant.<|im_end|>") == SYSTEM_IDS
    rendered = run(service.render_chat(chat("Hello"), "req-1"))
    assert rendered.token_ids == HELLO_IDS
    assert rendered.items == [] and rendered.request_id == "req-1" and rendered.model == MODEL
    body = rendered.to_generate_request()
    assert body.features is None and body.token_ids == HELLO_IDS


def test_string_content_and_multi_turn(service) -> None:
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again"}]})
    rendered = run(service.render_chat(req))
    assert rendered.prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert rendered.prompt.endswith("<|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\n")
    assert rendered.token_ids == service.template.encode(rendered.prompt)


def test_continue_final_message_and_template_kwargs(service) -> None:
    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello the"}],
        "continue_final_message": True})
    rendered = run(service.render_chat(req))
    assert rendered.prompt.endswith("<|im_start|>assistant\nHello the")
    _, url = png(56, 56)
    kwargs = {"add_vision_id": True, "tokenize": True}  # the reserved "tokenize" is ignored
    tagged = run(service.render_chat(chat(url, chat_template_kwargs=kwargs)))
    assert "Picture 1: <|vision_start|>" in tagged.prompt and tagged.items[0].length == 4


# ---- images ---------------------------------------------------------------------------------------

def test_one_image_chat_equals_the_real_processor(service, hf) -> None:
    image, url = png(448, 448)
    rendered = run(service.render_chat(chat(url, "What is this?")))
    assert [item.length for item in rendered.items] == [256]
    assert_matches_processor(rendered, hf, [image])
    assert list(rendered.items[0].metadata_item) == ["image_grid_thw"]


def test_two_image_chat_of_different_sizes_equals_the_real_processor(service, hf) -> None:
    (first, url1), (second, url2) = png(224, 224, 1), png(300, 200, 2)
    rendered = run(service.render_chat(chat("Compare", url1, "with", url2, "please")))
    assert [item.length for item in rendered.items] == [64, 77]
    assert rendered.items[0].offset < rendered.items[1].offset
    assert_matches_processor(rendered, hf, [first, second])


def test_generate_request_body_round_trips(service) -> None:
    _, url = png(224, 224, 3)
    rendered = run(service.render_chat(chat(url, "Hi", max_tokens=5, temperature=0, cache_salt="s1"), "rid"))
    body = GenerateRequest.model_validate(json.loads(rendered.to_generate_request().model_dump_json()))
    assert body.request_id == "rid" and body.cache_salt == "s1" and body.model == MODEL
    assert body.sampling_params.max_tokens == 5 and body.sampling_params.temperature == 0
    assert body.features.mm_hashes == {"image": [rendered.items[0].mm_hash]}
    placeholder = body.features.mm_placeholders["image"][0]
    assert (placeholder.offset, placeholder.length) == (rendered.items[0].offset, 64)
    kwargs = item_from_b64(body.features.kwargs_data["image"][0])
    assert np.array_equal(kwargs["pixel_values"].data, rendered.items[0].kwargs_item["pixel_values"].data)
    assert list(item_from_b64(body.features.mm_metadata["image"][0])) == ["image_grid_thw"]


def test_mm_hash_stable_and_content_sensitive(service) -> None:
    _, url_a = png(224, 224, 4)
    _, url_b = png(224, 224, 5)
    first = run(service.render_chat(chat(url_a, url_a, url_b)))
    again = run(service.render_chat(chat(url_a)))
    hashes = first.mm_hashes
    assert hashes[0] == hashes[1] == again.mm_hashes[0] != hashes[2]
    assert all(len(h) == 64 for h in hashes)


def test_render_is_identical_in_another_process_without_torch(service) -> None:
    _, url = png(300, 200, 6)  # resized: the torchvision-exact resize runs without torch
    here = run(service.render_chat(chat(url, "x")))
    code = (
        "import sys, json, asyncio; sys.modules['torch'] = None\n"
        "from services.render.serving import RenderService\n"
        "from services.protocol.openai import ChatCompletionRequest\n"
        f"svc = RenderService({str(service.model_path)!r}, {MODEL!r})\n"
        "req = ChatCompletionRequest.model_validate(json.loads(sys.stdin.read()))\n"
        "r = asyncio.run(svc.render_chat(req))\n"
        "blocked = sys.modules['torch'] is None\n"
        "print(json.dumps({'ids': r.token_ids, 'hashes': r.mm_hashes, 'torch': blocked}))\n"
    )
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONHASHSEED": "999"}
    out = subprocess.run([sys.executable, "-c", code], input=chat(url, "x").model_dump_json(), env=env,
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    there = json.loads(out.stdout.strip().splitlines()[-1])
    assert there == {"ids": here.token_ids, "hashes": here.mm_hashes, "torch": True}


# ---- limits and errors ----------------------------------------------------------------------------

def test_too_many_images(service) -> None:
    _, url = png(56, 56)
    with pytest.raises(InvalidRequest, match="max_images_per_request=3") as info:
        run(service.render_chat(chat(url, url, url, url)))
    assert info.value.code == "too_many_images" and "4" in info.value.message


def test_too_many_pixels(service) -> None:
    _, url = png(900, 900)
    with pytest.raises(InvalidRequest, match="810000") as info:
        run(service.render_chat(chat("look", url)))
    assert "max_image_pixels=640000" in info.value.message and info.value.code == "image_too_large"


def test_too_many_bytes(demo_model_path, service) -> None:
    from services.render.chat import MediaRef
    from services.render.multimodal import ImagePipeline

    _, url = png(224, 224)
    pipeline = ImagePipeline(service.images.processor, MediaPolicy(), RenderLimits(max_image_bytes=10_000),
                             MODEL, service.workers)
    with pytest.raises(InvalidRequest, match="max_image_bytes=10000") as info:
        run(pipeline.load([MediaRef(url)]))
    assert info.value.code == "media_too_large"


@pytest.mark.parametrize("url", ["data:image/png;base64,@@@not-base64@@@", "data:image/png;base64,aGVsbG8=",
                                 "data:image/png,plain"])
def test_bad_data_url(service, url) -> None:
    with pytest.raises(InvalidRequest, match="image 0"):
        run(service.render_chat(chat(url)))


def test_context_length(service) -> None:
    with pytest.raises(InvalidRequest, match="maximum context length is 32768") as info:
        run(service.render_chat(chat("Hello", max_tokens=32768)))
    assert info.value.code == "context_length_exceeded"
    run(service.render_chat(chat("Hello", max_tokens=32768 - len(HELLO_IDS))))


def test_model_check(service) -> None:
    with pytest.raises(NotFound, match="other-model") as info:   # 404, as OpenAI and vLLM answer
        run(service.render_chat(chat("Hello", model="other-model")))
    assert info.value.code == "model_not_found" and info.value.status == 404
    run(service.render_chat(chat("Hello", model="demo-alias")))
    run(service.render_chat(chat("Hello", model=None)))


@pytest.mark.parametrize(("message", "words"), [
    ({"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "data:x;base64,AA=="}}]},
     "only allowed in user messages"),
    ({"role": "tool", "content": "result"}, "unsupported role 'tool'"),
])
def test_message_rules(service, message, words) -> None:
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "a"}, message]})
    with pytest.raises(InvalidRequest, match=words):
        run(service.render_chat(req))


def test_literal_image_pad_in_text_is_refused(service) -> None:
    _, url = png(56, 56)
    with pytest.raises(InvalidRequest, match="2 image placeholders but 1 images"):
        run(service.render_chat(chat("<|vision_start|><|image_pad|><|vision_end|>", url)))


# ---- content_parts --------------------------------------------------------------------------------

def test_content_parts_equal_the_chat_path(service) -> None:
    _, url = png(300, 200, 7)
    via_chat = run(service.render_chat(chat(url, "Describe.")))
    collapsed = _collapse(via_chat.token_ids)
    for ids in (collapsed, via_chat.token_ids):
        parts = run(service.render_content_parts(ids, [{"type": "image_url", "url": url}], model=MODEL))
        assert parts.token_ids == via_chat.token_ids
        assert parts.mm_hashes == via_chat.mm_hashes
        for mine, theirs in zip(parts.items, via_chat.items, strict=True):
            assert (mine.offset, mine.length) == (theirs.offset, theirs.length)
            for key, elem in theirs.kwargs_item.items():
                assert np.array_equal(mine.kwargs_item[key].data, elem.data)
                assert mine.kwargs_item[key].field == elem.field
            assert list(mine.metadata_item) == list(theirs.metadata_item)


def test_content_parts_uuid_wrong_run_and_modality(service) -> None:
    _, url = png(224, 224, 8)
    ids = [1, 151652, IMAGE_PAD, 151653, 2]
    rendered = run(service.render_content_parts(ids, [{"type": "image_url", "url": url, "uuid": "my-id"}],
                                                sampling_params=SamplingParams(max_tokens=3), cache_salt="s"))
    assert rendered.mm_hashes == [scoped_uuid(service.images.model_id, "s", "my-id")] and rendered.cache_salt == "s"
    assert len(rendered.token_ids) == 4 + 64
    with pytest.raises(InvalidRequest, match="expected 1 or 64"):
        run(service.render_content_parts([151652, IMAGE_PAD, IMAGE_PAD, 151653], [{"type": "image_url",
                                                                                   "url": url}]))
    with pytest.raises(InvalidRequest, match="not supported") as info:
        run(service.render_content_parts(ids, [{"type": "audio_url", "url": url}]))
    assert info.value.code == "unsupported_modality"


def _collapse(ids: list[int]) -> list[int]:
    return [t for i, t in enumerate(ids) if t != IMAGE_PAD or ids[i - 1] != IMAGE_PAD]


# ---- completion, tokenize, detokenize -------------------------------------------------------------

def test_render_completion(service) -> None:
    req = CompletionRequest.model_validate({"model": MODEL, "prompt": ["Hello", "World"], "max_tokens": 4})
    prompts = run(service.render_completion(req, "c"))
    assert [p.request_id for p in prompts] == ["c-0", "c-1"]
    assert prompts[0].token_ids == [9707] and prompts[0].sampling_params.max_tokens == 4
    single = run(service.render_completion(CompletionRequest(prompt=[9707, 11]), "d"))
    assert [(p.request_id, p.token_ids, p.prompt) for p in single] == [("d", [9707, 11], None)]
    with pytest.raises(InvalidRequest, match="out of range"):
        run(service.render_completion(CompletionRequest(prompt=[10**7])))
    with pytest.raises(InvalidRequest, match="1 image placeholders but 0 images"):
        run(service.render_completion(CompletionRequest(prompt="<|vision_start|><|image_pad|><|vision_end|>")))


def test_tokenize_and_detokenize(service) -> None:
    assert run(service.tokenize(prompt="Hello")) == [9707]
    assert run(service.tokenize(messages=[{"role": "user", "content": "Hello"}])) == HELLO_IDS
    assert service.detokenize(HELLO_IDS).endswith("<|im_start|>assistant\n")
    assert service.detokenize(HELLO_IDS, skip_special_tokens=True).startswith("system\nYou are")
    with pytest.raises(InvalidRequest):
        service.detokenize([-1])


def test_processing_does_not_block_the_event_loop(service) -> None:
    _, url = png(800, 800, 9)
    req = chat(url, url, url)

    async def measure() -> tuple[float, int]:
        ticks = 0
        task = asyncio.ensure_future(service.render_chat(req))
        start = time.perf_counter()
        while not task.done():
            await asyncio.sleep(0.001)
            ticks += 1
        await task
        return time.perf_counter() - start, ticks

    elapsed, ticks = run(measure())
    # A blocked loop would tick once or twice; it keeps turning while the pool works.
    assert ticks >= 5, (elapsed, ticks)
