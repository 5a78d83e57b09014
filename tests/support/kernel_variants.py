"""Run a test under one variant of a kernel: the better variants' CPU features masked (EPD_CPU_FEATURES_OFF),
the loader's decisions forgotten before and after, so the kernel's wrapper loads exactly that variant."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from services.kernels import cpu, loader
from services.kernels.spec import KERNELS, VARIANTS


def runnable(name: str) -> list[str]:
    """The variants of kernel `name` this host's CPU can run (detected features, nothing masked)."""
    have = cpu.detected()
    return [v for v in KERNELS[name].variants if set(VARIANTS[v].features) <= have]


def mask_for(name: str, variant: str) -> str:
    """EPD_CPU_FEATURES_OFF that leaves `variant` the best of `name`'s variants this CPU runs."""
    order = KERNELS[name].variants
    better = {f for v in order[:order.index(variant)] for f in VARIANTS[v].features}
    return ",".join(sorted(better - set(VARIANTS[variant].features)))


@contextmanager
def only_variant(monkeypatch: pytest.MonkeyPatch, name: str, variant: str) -> Iterator[None]:
    monkeypatch.setenv(cpu.ENV, mask_for(name, variant))
    loader.reset()
    try:
        got = loader.load(name)
        assert got.variant == variant, f"{name}: the host runs {variant} but {got.variant} loaded ({got.reason})"
        yield
    finally:
        monkeypatch.delenv(cpu.ENV)
        loader.reset()
