"""RenderService for every family: token ids and pixels equal the family's HF processor; text-only refuses images."""

from __future__ import annotations

import asyncio

import pytest

from services.models.processing import load_processor
from services.protocol.errors import InvalidRequest
from services.protocol.openai import ChatCompletionRequest
from services.render.serving import RenderService
from tests.services.render.test_serving import chat, png
from tests.support.pixels import assert_pixels_match

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "llava")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    from services.models.tiny import tiny_model_path

    path = tiny_model_path(request.param)
    service = RenderService(path, "m")
    yield request.param, service, load_processor(path)
    service.close()


@pytest.fixture(scope="module")
def text_service():
    from services.models.tiny import tiny_model_path

    service = RenderService(tiny_model_path("qwen2"), "tiny-qwen2")
    yield service
    service.close()


def test_two_images_render_like_the_processor(family):
    name, service, hf = family
    (first, first_url), (second, second_url) = png(224, 336, 1), png(448, 280, 2)
    rendered = asyncio.run(service.render_chat(chat(first_url, second_url, "Compare.", model="m")))
    expected = hf(text=[rendered.prompt], images=[first, second], return_tensors="np")
    assert rendered.token_ids == expected["input_ids"][0].tolist()
    rows = 0
    for item, image in zip(rendered.items, (first, second), strict=True):
        pixels = item.kwargs_item["pixel_values"].data
        assert_pixels_match(pixels, expected["pixel_values"][rows:rows + len(pixels)], image, hf.image_processor)
        rows += len(pixels)
    assert rows == len(expected["pixel_values"])
    pad = service.spec.image_token_id
    for item in rendered.items:
        assert rendered.token_ids[item.offset:item.offset + item.length] == [pad] * item.length
        assert set(item.metadata_item) == set(service.spec.metadata_keys) & {"image_grid_thw", "image_sizes"}
    assert (service.spec.start_token_id is None) == (name == "llava")


def test_string_content_reaches_a_template_that_iterates_parts(family):
    _, service, _ = family
    request = {"model": "m", "messages": [{"role": "user", "content": "Hello there."}]}
    rendered = asyncio.run(service.render_chat(ChatCompletionRequest.model_validate(request)))
    assert "Hello there." in rendered.prompt


def test_text_only_model_refuses_images(text_service):
    with pytest.raises(InvalidRequest, match="does not accept images") as error:
        asyncio.run(text_service.render_chat(chat(png(64, 64)[1], "What is this?", model="tiny-qwen2")))
    assert error.value.code == "images_not_supported"


def test_text_only_model_flattens_text_parts(text_service):
    rendered = asyncio.run(text_service.render_chat(chat("What is", "the capital?", model="tiny-qwen2")))
    assert "What is\nthe capital?" in rendered.prompt and rendered.items == []
