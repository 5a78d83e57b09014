"""Render's media intake: turn a client's image URL into a decoded RGB image plus its original bytes.

Threat model (details in each module): URLs and bytes come from untrusted clients.
- media_policy: what may be fetched; host, domain and address checks that stop SSRF in every
  spelling of an internal address, on every redirect hop.
- media_fetch: resolves each host once and connects only to the checked addresses; one deadline,
  a byte limit enforced while reading, no proxies, cookies or transparent decompression.
- image_decode: only allowed formats, pixel limit from the header before decoding, full decode so
  corrupt files fail early, RGB conversion matching the HF processors.
Every refusal is an `InvalidRequest` (HTTP 400) with a precise `code`.

Called by: render's serving code, which hashes the returned bytes into the mm_hash.
"""

from __future__ import annotations

import asyncio

import aiohttp
from PIL import Image

from services.render.image_decode import decode_image, to_rgb
from services.render.media_fetch import create_media_session, decode_data_url, fetch_media
from services.render.media_policy import MediaPolicy

__all__ = [
    "MediaPolicy",
    "create_media_session",
    "decode_data_url",
    "decode_image",
    "fetch_media",
    "load_image",
    "to_rgb",
]


async def load_image(
    url: str, policy: MediaPolicy, session: aiohttp.ClientSession | None = None
) -> tuple[Image.Image, bytes]:
    """The decoded RGB image and the original encoded bytes (what render hashes for mm_hash)."""
    data = await fetch_media(url, policy, session)
    image = await asyncio.to_thread(decode_image, data, policy)
    return image, data
