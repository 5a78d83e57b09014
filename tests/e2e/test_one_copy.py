"""One copy per hop, measured on a real cluster: KV bytes copied per request / KV size = 2, embeddings likewise.

KV: prefill fills the KV store's memory in place (put_into: 1x), decode reads a zero-copy view (0x) and copies
it once into its blocks (1x).  Embeddings: encode puts them into the EC store (1x), prefill reads a view (0x)
and its scatter into the prompt embeddings is the one copy.  Every figure is a counter the roles export.
"""

from __future__ import annotations

import json

from tests.support.cluster import metric_value
from tests.support.images import chat, noise_image

COUNTERS = {("prefill", "epd_kv_store_bytes_copied_total"), ("decode", "epd_kv_store_bytes_copied_total"),
            ("decode", "epd_decode_kv_copied_bytes_total"), ("encode", "epd_ec_store_bytes_copied_total"),
            ("prefill", "epd_ec_store_bytes_copied_total")}


def _read(cluster) -> dict[tuple[str, str], float]:
    texts = {role: cluster.metrics(role) for role in ("encode", "prefill", "decode")}
    return {(role, name): metric_value(texts[role], name) for role, name in COUNTERS}


def _text_config(path) -> dict:
    config = json.loads((path / "config.json").read_text())
    return config.get("text_config", config)


def test_kv_and_embeddings_are_copied_twice_per_hop_pair(shm_cluster, demo_model_path):
    text = _text_config(demo_model_path)
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    kv_bytes_per_token = text["num_hidden_layers"] * 2 * text["num_key_value_heads"] * head_dim * 4  # float32
    before = _read(shm_cluster)
    with shm_cluster.client() as client:
        reply = client.post("/v1/chat/completions", json=chat("Count.", [noise_image(224, 224, seed=931)],
                                                              max_tokens=3, temperature=0))
    assert reply.status_code == 200, reply.text
    moved = {key: value - before[key] for key, value in _read(shm_cluster).items()}
    kv_size = reply.json()["usage"]["prompt_tokens"] * kv_bytes_per_token
    embedding = 64 * text["hidden_size"] * 4  # (64 tokens of a 224x224 image, hidden) float32

    assert moved[("prefill", "epd_kv_store_bytes_copied_total")] == kv_size   # put_into: the fill
    assert moved[("decode", "epd_kv_store_bytes_copied_total")] == 0          # a view
    assert moved[("decode", "epd_decode_kv_copied_bytes_total")] == kv_size   # into its blocks, once
    kv_copied = sum(moved[(r, n)] for r, n in COUNTERS if "kv" in n)
    assert kv_copied / kv_size == 2

    assert moved[("encode", "epd_ec_store_bytes_copied_total")] == embedding  # the put
    assert moved[("prefill", "epd_ec_store_bytes_copied_total")] == 0         # a view held through the forward
