"""Deterministic test images and data URLs."""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image


def noise_image(width: int, height: int, seed: int = 0) -> Image.Image:
    pixels = np.random.RandomState(seed).randint(0, 256, size=(height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def encode(image: Image.Image, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(encode(image, fmt)).decode()


def chat(text: str, images: list[Image.Image] = (), **extra) -> dict:
    """An OpenAI chat body: the images first, then the text, in one user message."""
    parts = [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
    content = [*parts, {"type": "text", "text": text}] if images else text
    return {"messages": [{"role": "user", "content": content}], **extra}
