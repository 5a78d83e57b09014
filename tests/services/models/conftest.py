"""Fixtures for the model-layer tests: the tiny demo checkpoint, its processor, and its two parts."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def model_path(demo_model_path):
    return demo_model_path


@pytest.fixture(scope="module")
def processor(model_path):
    from services.models.processing import load_processor

    return load_processor(model_path)


@pytest.fixture(scope="module")
def adapter(model_path):
    from services.models.registry import adapter_for

    return adapter_for(model_path)


@pytest.fixture(scope="module")
def vision(adapter, model_path):
    return adapter.load_vision(model_path, "cpu", "float32")


@pytest.fixture(scope="module")
def lm(adapter, model_path):
    return adapter.load_language(model_path, "cpu", "float32")
