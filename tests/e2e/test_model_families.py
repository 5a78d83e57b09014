"""Every supported family, served by a real cluster, answers exactly like `generate` in one process.

One cluster per family (tiny random checkpoint from services.models.tiny; test_video.py's
Qwen2.5-VL and Qwen3-VL ones are the same clusters: tests/support/family_clusters.py), a
text chat and, for VLM families, a one- and a two-image chat; greedy output
through the coordinator must equal `model.generate(do_sample=False)` token for
token.  Text-only families run no encoder and refuse images with a 400.
(Qwen2-VL, the demo model, is covered by test_exactness.py; it joins here on
a GPU.)  EPD_TEST_DEVICE=cuda runs the clusters and the reference on CUDA
(scripts/gpu_check.sh); such runs skip without a CUDA device.
"""

from __future__ import annotations

import os

import pytest

from tests.support.images import chat, noise_image

MAX_TOKENS = 8
DEVICE = os.environ.get("EPD_TEST_DEVICE", "cpu")
VLMS = ["qwen2_5_vl", "qwen3_vl", "llava"] + (["qwen2_vl"] if DEVICE != "cpu" else [])
CASES = {
    "text": ("Tell me a story about a lighthouse.", []),
    "one_image": ("Describe this image.", [(448, 448, 1)]),
    "two_images": ("Compare these two images.", [(224, 336, 2), (448, 280, 3)]),
}


def family_key(params: dict) -> tuple[str, str] | None:
    """The family cluster a test with these parameters uses (tests/support/family_clusters.py)."""
    family = params.get("vlm") or params.get("text_lm")
    return (family, DEVICE) if family else None


def _serve(family: str, families):
    """(family, running cluster, reference); the caller releases the cluster."""
    from services.models.tiny import tiny_model_path
    from tests.support.reference import Reference

    if DEVICE != "cpu":
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("EPD_TEST_DEVICE is set but no CUDA device is available")
    cluster = families.cluster(__name__, (family, DEVICE))   # test_video.py serves Qwen2.5-VL and Qwen3-VL too
    return family, cluster, Reference(tiny_model_path(family), device=DEVICE)


@pytest.fixture(scope="module", params=VLMS)
def vlm(request, family_clusters):
    name, cluster, reference = _serve(request.param, family_clusters)
    yield name, cluster, reference
    family_clusters.release(__name__, (name, DEVICE))   # stopped unless test_video.py needs it next


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def text_lm(request, family_clusters):
    name, cluster, reference = _serve(request.param, family_clusters)
    yield name, cluster, reference
    family_clusters.release(__name__, (name, DEVICE))


def _ask(cluster, text, images):
    body = chat(text, images, max_tokens=MAX_TOKENS, temperature=0, return_token_ids=True)
    with cluster.client() as client:
        return client.post("/v1/chat/completions", json=body)


def _check_exact(cluster, reference, case: str) -> None:
    text, spec = CASES[case]
    images = [noise_image(w, h, seed) for w, h, seed in spec]
    reply = _ask(cluster, text, images)
    assert reply.status_code == 200, reply.text
    expected = reference.greedy(text, images, MAX_TOKENS)
    assert reply.json()["choices"][0]["token_ids"] == expected
    assert len(expected) == MAX_TOKENS  # no early stop: the whole continuation was compared


@pytest.mark.parametrize("case", sorted(CASES))
def test_vlm_greedy_tokens_equal_generate(vlm, case):
    _, cluster, reference = vlm
    _check_exact(cluster, reference, case)


def test_text_lm_greedy_tokens_equal_generate(text_lm):
    _, cluster, reference = text_lm
    _check_exact(cluster, reference, "text")


def test_text_lm_refuses_images_and_runs_no_encoder(text_lm):
    _, cluster, _ = text_lm
    reply = _ask(cluster, "Describe this image.", [noise_image(64, 64, 0)])
    assert reply.status_code == 400, reply.text
    assert "does not accept images" in reply.text
    assert cluster.http_urls("encode") == []
