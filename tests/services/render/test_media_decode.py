"""decode_image (services/render/image_decode.py), also behind a fetch (services/render/media_fetch.py)."""

from __future__ import annotations

import asyncio
import base64
import time
import warnings

import pytest
from PIL import Image

from services.protocol.errors import InvalidRequest
from services.render.image_decode import decode_image
from services.render.media_fetch import fetch_media
from services.render.media_policy import MediaPolicy

POLICY = MediaPolicy()


async def load_image(url: str, policy: MediaPolicy) -> tuple[Image.Image, bytes]:
    """The decoded RGB image and the original encoded bytes, as render's request path gets them."""
    data = await fetch_media(url, policy)
    return await asyncio.to_thread(decode_image, data, policy), data


def refused(data: bytes, policy: MediaPolicy = POLICY) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        decode_image(data, policy)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize("name", ["png", "jpeg", "gif", "webp", "bmp", "tiny_png", "rgba_png", "la_png",
                                  "palette_png", "gray16_png", "bilevel_png", "cmyk_jpeg"])
def test_good_images_decode_to_rgb(name: str, media_images) -> None:
    image = decode_image(media_images[name], POLICY)
    assert image.mode == "RGB" and image.width >= 1 and image.height >= 1
    image.tobytes()  # fully decoded, usable after the source bytes are gone


def test_one_pixel_is_valid(media_images) -> None:
    image = decode_image(media_images["tiny_png"], POLICY)
    assert image.size == (1, 1) and image.getpixel((0, 0)) == (10, 20, 30)


def test_alpha_composited_on_white_and_16_bit_scaled(media_images) -> None:
    assert decode_image(media_images["rgba_png"], POLICY).getpixel((0, 0)) == (255, 255, 255)
    assert decode_image(media_images["la_png"], POLICY).getpixel((0, 0)) == (255, 255, 255)
    palette = decode_image(media_images["palette_png"], POLICY)
    assert palette.getpixel((1, 1)) == (255, 255, 255)  # index 0 is transparent
    assert palette.getpixel((0, 0)) == (0, 0, 255)
    gray = decode_image(media_images["gray16_png"], POLICY)
    assert [gray.getpixel((x, 0)) for x in range(3)] == [(0, 0, 0), (128, 128, 128), (255, 255, 255)]
    assert decode_image(media_images["cmyk_jpeg"], POLICY).getpixel((0, 0))[1] < 64  # magenta, not white


@pytest.mark.parametrize(
    "name, fragment",
    [("text", "not an image"), ("tiff", "not an image"), ("eps", "not an image"),
     ("truncated_png", "truncated or corrupt"), ("truncated_jpeg", "truncated or corrupt"),
     ("corrupt_png", "truncated or corrupt")],
)
def test_bad_files(name: str, fragment: str, media_images) -> None:
    error = refused(media_images[name])
    assert error.code == "invalid_image" and fragment in error.message


def test_empty_and_garbage() -> None:
    assert refused(b"").code == "invalid_image"
    assert refused(b"\x89PNG\r\n\x1a\n" + b"\0" * 40).code == "invalid_image"


def test_other_formats_only_when_allowed(media_images) -> None:
    assert decode_image(media_images["tiff"], MediaPolicy(allowed_image_formats=("TIFF",))).mode == "RGB"
    assert refused(media_images["png"], MediaPolicy(allowed_image_formats=("JPEG",))).code == "invalid_image"


@pytest.mark.parametrize("name", ["bomb_png", "large_png"])
def test_decompression_bombs_refused_from_the_header(name: str, media_images) -> None:
    started = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no DecompressionBombWarning either
        error = refused(media_images[name])
    assert error.code == "image_too_large" and time.monotonic() - started < 1.0
    assert len(media_images[name]) < 64 * 1024


def test_pixel_limit_is_the_policys(media_images) -> None:
    assert refused(media_images["png"], MediaPolicy(max_image_pixels=64 * 64 - 1)).code == "image_too_large"
    assert decode_image(media_images["png"], MediaPolicy(max_image_pixels=64 * 64)).size == (64, 64)
    assert Image.MAX_IMAGE_PIXELS == 89_478_485  # never mutated by the media code


def test_load_image_returns_image_and_original_bytes(media_server, media_images, media_net_guard) -> None:
    policy = MediaPolicy(allowed_private_networks=("127.0.0.1/32",))
    image, data = asyncio.run(load_image(media_server.url("/image/jpeg"), policy))
    assert image.mode == "RGB" and image.size == (64, 64) and data == media_images["jpeg"]
    payload = base64.b64encode(media_images["png"]).decode()
    image, data = asyncio.run(load_image(f"data:image/png;base64,{payload}", POLICY))
    assert data == media_images["png"] and image.size == (64, 64)
    with pytest.raises(InvalidRequest) as info:
        asyncio.run(load_image(media_server.url("/image/truncated_png"), policy))
    assert info.value.code == "invalid_image"
    with pytest.raises(InvalidRequest) as info:
        asyncio.run(load_image(media_server.url("/image/bomb_png"), policy))
    assert info.value.code == "image_too_large"
