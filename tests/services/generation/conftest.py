"""The demo model's real Qwen2 tokenizer (no weights): what the generation rules are tried with."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer(demo_model_path):
    from services.models.processing import load_tokenizer

    return load_tokenizer(demo_model_path)
