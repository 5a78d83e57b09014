"""Decode untrusted image bytes into an RGB PIL image, or refuse them with InvalidRequest.

Threat model: the bytes are hostile.  Only the policy's formats are tried (PIL's other decoders,
Ghostscript-backed EPS above all, stay unreachable); the pixel count is read from the header and
checked before any pixel is decoded (decompression bombs); the whole image is then decoded so a
truncated or corrupt file fails here, not later inside the HF processor.  PIL's own global
MAX_IMAGE_PIXELS is left untouched as a backstop (MediaPolicy keeps ours at or below it), and epd
never sets ImageFile.LOAD_TRUNCATED_IMAGES, which would let truncated files through.

Called by: render's worker processes (services/render/workers.py: decoding is
CPU-bound); `image_size` (header only) by render's main process to check limits before any decode.  Error codes:
invalid_image (not an image, unsupported format, corrupt or truncated), image_too_large.
"""

from __future__ import annotations

import io

from PIL import Image, UnidentifiedImageError

from services.protocol.errors import InvalidRequest
from services.render.media_policy import MediaPolicy

INVALID_IMAGE = "invalid_image"
TOO_LARGE = "image_too_large"
_ALPHA_MODES = frozenset({"RGBA", "RGBa", "LA", "La", "PA"})
_WIDE_GRAY_MODES = frozenset({"I", "I;16", "I;16L", "I;16B", "I;16N"})


def decode_image(data: bytes, policy: MediaPolicy) -> Image.Image:
    """A fully decoded RGB image; any size from 1x1 up (the processor resizes)."""
    if not data:
        raise InvalidRequest("image is empty", code=INVALID_IMAGE)
    image = _open(data, policy)
    _check_pixels(image, policy)
    _load(image)
    return _as_rgb(image)


def image_size(data: bytes, policy: MediaPolicy) -> tuple[int, int]:
    """(width, height) from the header only, checked against the pixel limit; no pixel is decoded."""
    if not data:
        raise InvalidRequest("image is empty", code=INVALID_IMAGE)
    image = _open(data, policy)
    try:
        _check_pixels(image, policy)
        return image.size
    finally:
        image.close()


def _open(data: bytes, policy: MediaPolicy) -> Image.Image:
    """Parse the header only."""
    try:
        return Image.open(io.BytesIO(data), formats=policy.allowed_image_formats)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        # Raised (or warned, under -W error) by PIL's own header check: far above any sane image.
        raise InvalidRequest("image dimensions exceed the pixel limit", code=TOO_LARGE) from None
    except UnidentifiedImageError:
        formats = ", ".join(policy.allowed_image_formats)
        raise InvalidRequest(f"not an image in an accepted format ({formats})", code=INVALID_IMAGE) from None
    except Exception as exc:  # noqa: BLE001 - PIL's parsers raise many types on hostile headers
        raise InvalidRequest(f"image header is corrupt ({type(exc).__name__})", code=INVALID_IMAGE) from None


def _check_pixels(image: Image.Image, policy: MediaPolicy) -> None:
    width, height = image.size
    if width < 1 or height < 1:
        raise InvalidRequest(f"image has no pixels ({width}x{height})", code=INVALID_IMAGE)
    if width * height > policy.max_image_pixels:
        raise InvalidRequest(f"image is {width}x{height} = {width * height} pixels, "
                             f"limit {policy.max_image_pixels}", code=TOO_LARGE)


def _load(image: Image.Image) -> None:
    """Decode every pixel of the first frame now, so corruption surfaces as a 400 here."""
    try:
        image.load()
    except Exception as exc:  # noqa: BLE001 - truncation is OSError, bad streams anything from zlib to struct
        raise InvalidRequest(f"image data is truncated or corrupt ({type(exc).__name__})",
                             code=INVALID_IMAGE) from None


def _as_rgb(image: Image.Image) -> Image.Image:
    try:
        return to_rgb(image)
    except (ValueError, OSError) as exc:
        raise InvalidRequest(f"image mode {image.mode} cannot be converted to RGB ({exc})",
                             code=INVALID_IMAGE) from None


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB the way HF processors expect: alpha composited on white, 16-bit gray scaled, not clipped."""
    if image.mode == "RGB":
        return image
    if image.mode in _WIDE_GRAY_MODES:
        # PIL clips 16-bit values to 255 on convert("L"); scale the 0..65535 range instead.
        image = image.convert("I").point(lambda value: value / 257).convert("L")
    if "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in _ALPHA_MODES:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")
