"""Backends by name, imported only when used (the coordinator can import this without torch)."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from services.connectors.base import StoreConfig, TensorStore

# name -> "module:class"; adding a backend is one line here plus its module.
BACKENDS: dict[str, str] = {
    "redis": "services.connectors.redis_store:RedisTensorStore",
    "shm": "services.connectors.shm:ShmTensorStore",
}


def supported_backends() -> list[str]:
    return sorted(BACKENDS)


def store_class(backend: str) -> Callable[[StoreConfig], TensorStore]:
    """The store class registered as `backend`; ValueError listing the supported names otherwise."""
    try:
        module_name, class_name = BACKENDS[backend].split(":")
    except KeyError:
        raise ValueError(f"unknown connector backend {backend!r}; supported: "
                         f"{', '.join(supported_backends())}") from None
    return getattr(importlib.import_module(module_name), class_name)


def create_store(config: StoreConfig) -> TensorStore:
    return store_class(config.backend)(config)


def sweep_stale_segments(namespace: str = "epd") -> list[str]:
    """Remove the shm segments of `namespace` whose owner process is gone; return their names."""
    from services.connectors.shm_segment import sweep_stale_segments as sweep

    return sweep(namespace)
