"""cache_salt reaches prefill's prefix-cache key on every input path; hits never change the output.

Per path: a fresh salt misses, the same salt again hits every full block but the last token's, another
salt misses, and the same tokens with another image (same size, so the same token ids) miss: the image
sits in block 0, so no block of that prompt may be reused.
"""

from __future__ import annotations

import uuid

import pytest

from tests.support.images import chat, data_url, noise_image
from tests.support.scale_out import Orchestrator

HIT_TOKENS = "epd_prefill_prefix_cache_hit_tokens_total"
BLOCK = 16
TEXT = "Describe the picture in detail, then list every colour you can see in it, one per line. " * 3


@pytest.fixture(scope="module")
def orch(shm_cluster):
    orchestrator = Orchestrator(shm_cluster)
    yield orchestrator
    orchestrator.close()


def _tokens(answer):
    return answer["choices"][0]["token_ids"]


def via_chat(orch, image, salt):
    body = chat(TEXT, [image], max_tokens=4, temperature=0, cache_salt=salt, return_token_ids=True)
    return _tokens(orch.ok("coordinator", "/v1/chat/completions", body))


def via_features(orch, image, salt):
    rendered = orch.render(chat(TEXT, [image], max_tokens=4, temperature=0, cache_salt=salt))
    assert rendered["cache_salt"] == salt
    return _tokens(orch.ok("coordinator", "/inference/v1/generate", rendered))


def via_content_parts(orch, image, salt):
    ids = orch.render(chat(TEXT, [image]))["token_ids"]
    body = {"token_ids": ids, "content_parts": [{"type": "image_url", "url": data_url(image)}],
            "cache_salt": salt, "sampling_params": {"max_tokens": 4, "temperature": 0}}
    return _tokens(orch.ok("coordinator", "/inference/v1/generate", body))


def via_orchestrator(orch, image, salt):
    """Straight to the roles: the salt rides in the render answer that prefill gets."""
    generate = orch.render(chat(TEXT, [image], max_tokens=4, temperature=0, cache_salt=salt))
    ec = orch.encode(generate)["ec_transfer_params"]
    prefill = orch.ok("prefill", "/inference/v1/generate", orch.prefill_body(generate, ec))
    decoded = orch.ok("decode", "/inference/v1/generate", orch.decode_body(generate, prefill["kv_transfer_params"]))
    return _tokens(decoded)


PATHS = {"chat": via_chat, "features": via_features, "content_parts": via_content_parts,
         "orchestrator": via_orchestrator}


def _measure(orch, run, image, salt):
    before = orch.metric("prefill", HIT_TOKENS)
    tokens = run(orch, image, salt)
    return orch.metric("prefill", HIT_TOKENS) - before, tokens


@pytest.mark.parametrize("path", sorted(PATHS))
def test_cache_salt_keys_the_prefix_cache(orch, path):
    run = PATHS[path]
    image, other_image = noise_image(56, 56, 50), noise_image(56, 56, 51)
    salt, other_salt = f"{path}-{uuid.uuid4().hex}", f"{path}-{uuid.uuid4().hex}"
    num_prompt = len(orch.render(chat(TEXT, [image]))["token_ids"])
    first = _measure(orch, run, image, salt)
    again = _measure(orch, run, image, salt)
    salted = _measure(orch, run, image, other_salt)
    swapped = _measure(orch, run, other_image, salt)
    assert first[0] == 0, "a fresh salt must not hit blocks cached under other salts (or other paths)"
    assert again[0] == (num_prompt - 1) // BLOCK * BLOCK > 0
    assert salted[0] == 0
    assert swapped[0] == 0
    assert first[1] == again[1] == salted[1]
