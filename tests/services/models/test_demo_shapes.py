"""The demo checkpoints' shapes: the aliases name them, and demo-deep is the second shape benchmarks check on."""

from __future__ import annotations

from services.config import DEMO_ALIASES
from services.models.demo import SIZES, build_demo_config


def test_every_alias_names_a_size():
    assert {size for size, _ in DEMO_ALIASES.values()} == set(SIZES)


def test_deep_has_more_layers_fewer_heads_and_about_the_medium_compute():
    medium, deep = build_demo_config("medium").text_config, build_demo_config("deep").text_config
    assert (deep.num_hidden_layers, deep.num_attention_heads, deep.num_key_value_heads) == (16, 6, 2)
    assert deep.hidden_size // deep.num_attention_heads == 128   # the real Qwen2-VL's head_dim
    assert deep.rope_parameters["mrope_section"] == [16, 24, 24]   # the real Qwen2-VL's sections

    def per_token(c) -> int:   # weights a token goes through, head aside
        head_dim = c.hidden_size // c.num_attention_heads
        attention = c.hidden_size * head_dim * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
        return c.num_hidden_layers * (attention + 3 * c.hidden_size * c.intermediate_size)

    assert 0.9 < per_token(deep) / per_token(medium) < 1.2
