"""A ready-to-paste request for the ready banner and the README: with a real (tiny, generated) image for a
vision-language model, a question with a known answer for a text-only one."""

from __future__ import annotations

import base64
import io
import json


def tiny_png_data_url(size: int = 56) -> str:
    from PIL import Image

    image = Image.new("RGB", (size, size))
    image.putdata([(x * 4 % 256, y * 4 % 256, 128) for y in range(size) for x in range(size)])
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def chat_body(model: str, images: bool = True) -> dict:
    if not images:
        return {"model": model, "max_tokens": 16, "temperature": 0,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    return {"model": model, "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": tiny_png_data_url()}},
                {"type": "text", "text": "What is in this image?"}]}]}


def curl_example(url: str, model: str, images: bool = True, with_key: bool = False) -> str:
    """The request; with API keys configured it sends $EPD_API_KEY (the banner never prints a key)."""
    body = json.dumps(chat_body(model, images))
    auth = ' -H "Authorization: Bearer $EPD_API_KEY"' if with_key else ""
    return f"curl -s {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'"
