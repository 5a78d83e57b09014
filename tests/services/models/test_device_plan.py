"""--device decides once what a model role runs: on CUDA no CPU-only op or entry point is reached.

No GPU here, so the CUDA branch is checked by what it would call: each role's model preparation runs on the CUDA
plan over a model on the "meta" device with every CPU-only entry point turned into a failure (the same spies fire
on the CPU plan: the positive control), and the CUDA decode step's forward is traced op by op.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from services.config import EpdConfig
from services.models.device_plan import DevicePlan, is_cuda, plan_for

CPU_ONLY_NAMESPACES = {"mkldnn", "epd", "quantized"}


class CpuOnlyCalled(AssertionError):
    pass


@pytest.fixture
def cpu_only_spies(monkeypatch):
    """Every CPU-only entry point raises CpuOnlyCalled (C kernels, oneDNN packing, fused modules, thread knobs)."""
    from services.hostcpu import compute_threads, role_cpu
    from services.kernels import loader
    from services.models import attention_kernel, fused_mlp, head_screen, packed_linear, panel_linear

    def spy(name):
        def called(*args, **kwargs):
            raise CpuOnlyCalled(name)
        return called

    for owner, name in [(loader, "load"), (packed_linear, "pack_weight"), (panel_linear.PanelLinear, "__init__"),
                        (fused_mlp.FusedGatedMLP, "__init__"), (fused_mlp.InPlaceActMLP, "__init__"),
                        (fused_mlp.GemmPatchEmbed, "__init__"),
                        (attention_kernel, "load"), (head_screen.HeadScreen, "__init__"),
                        (compute_threads, "apply"), (role_cpu, "apply")]:
        monkeypatch.setattr(owner, name, spy(f"{getattr(owner, '__name__', owner)}.{name}"))


def test_the_plans_exactly():
    assert plan_for(EpdConfig()) == DevicePlan("cpu", True, "auto", True, True, "auto", "auto", "auto", True)
    assert plan_for(EpdConfig.of(device="cuda:1")) == DevicePlan("cuda:1", False, "default", False, False, "off", "off",
                                                              "flex", False)
    assert plan_for(EpdConfig.of(linear_kernel="default")).fused_kernels is False
    assert is_cuda("cuda") and is_cuda(torch.device("cuda", 3)) and not is_cuda("cpu")


@pytest.fixture(scope="module")
def tiny_path():
    from services.models.demo import demo_model_path

    return demo_model_path("tiny")


def _meta_parts(path):
    from services.models.registry import adapter_for

    adapter = adapter_for(path)
    return adapter.load_vision(path, "meta", "float32"), adapter.load_language(path, "meta", "float32", 512)


def test_no_role_prepares_a_cpu_only_kernel_on_cuda(tiny_path, cpu_only_spies):
    from services.decode.app import prepare as prepare_decode
    from services.encode.app import prepare as prepare_encode
    from services.models.swapped import SwappedLinear
    from services.prefill.app import prepare as prepare_prefill

    config = EpdConfig.of(device="cuda")
    plan = plan_for(config)
    vision, lm = _meta_parts(tiny_path)
    assert prepare_encode(vision, plan).kernel == "default"
    assert prepare_prefill(lm, plan).kernel == "default"
    assert prepare_decode(lm, config, plan).kernel == "default"
    modules = [*vision.tower.modules(), *lm.model.modules(), lm.lm_head]
    assert not [m for m in modules if isinstance(m, SwappedLinear) or "Fused" in type(m).__name__]


def test_the_spies_catch_the_cpu_plan_positive_control(tiny_path, cpu_only_spies, monkeypatch):
    from services.encode.app import prepare as prepare_encode
    from services.models import fused_mlp
    from services.prefill.app import prepare as prepare_prefill

    def fused(*args, **kwargs):
        raise CpuOnlyCalled("fuse_mlps")

    # meta weights are never packed, so prefill's CPU path shows in the one call it makes only on CPU: its MLPs fused
    monkeypatch.setattr(fused_mlp, "fuse_mlps", fused)
    vision, lm = _meta_parts(tiny_path)
    plan = plan_for(EpdConfig.of(linear_kernel="prepacked"))
    with pytest.raises(CpuOnlyCalled):
        prepare_encode(vision, plan)
    with pytest.raises(CpuOnlyCalled):
        prepare_prefill(lm, plan)


def test_cuda_attention_is_flex_compiled_and_elsewhere_eager():
    from services.decode import flex_paged

    compiled = flex_paged.flex_function(torch.device("cuda", 0))   # compiled lazily: no GPU needed to make it
    assert compiled is flex_paged.flex_function(torch.device("cuda", 1)) and compiled is not flex_paged._eager
    assert flex_paged.flex_function(torch.device("cpu")) is flex_paged._eager


def test_the_decode_engine_takes_the_cuda_step_by_device_and_refuses_cpu_kernels_there():
    from services.decode.runners import uses_gpu_step

    cuda, cpu = SimpleNamespace(device=torch.device("cuda", 0)), SimpleNamespace(device=torch.device("cpu"))
    assert uses_gpu_step(cuda, "auto") and uses_gpu_step(cuda, "flex")
    assert not uses_gpu_step(cpu, "auto") and not uses_gpu_step(cpu, "c") and uses_gpu_step(cpu, "flex")
    for kernel in ("c", "torch"):
        with pytest.raises(ValueError, match=f"decode attention '{kernel}' is CPU-only"):
            uses_gpu_step(cuda, kernel)


class _Ops(TorchDispatchMode):
    """Records every op dispatched."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_the_cuda_decode_step_dispatches_only_device_generic_ops(tiny_path, cpu_only_spies):
    """The CUDA step's code run here (CPU tensors, eager flex) dispatches the ops it would on CUDA: none CPU-only."""
    from services.decode.block_pool import BlockPool
    from services.decode.gpu_forward import GpuDecoder
    from services.models.registry import adapter_for

    lm = adapter_for(tiny_path).load_language(tiny_path, "cpu", "float32", 512)   # as the CUDA plan leaves it
    pool = BlockPool(lm.layout, 1 << 20, 16, heads_major=True)
    decoder = GpuDecoder(lm, pool, 4, 32)
    calls = []

    def flex(q, k, v, **kwargs):   # flex_attention itself: the compiled kernel on CUDA (flex_function), stubbed here
        calls.append(kwargs["block_mask"])
        return torch.zeros_like(q)

    decoder.flex = flex
    with _Ops() as seen:
        logits, tokens = decoder.forward(4)
    assert logits.shape == (4, lm.vocab_size) and tokens.shape == (4,)
    assert len(calls) == len(decoder.layers) and calls[0] is decoder.mask.for_rows(4)   # one mask per bucket
    assert {op.split(".")[0] for op in seen.ops} <= {"aten", "prims"}
    assert not {op for op in seen.ops if op.split(".")[0] in CPU_ONLY_NAMESPACES or "mkldnn" in op}
    assert "aten.index_copy_" in seen.ops and "aten.scatter_" in seen.ops   # the KV write, the mask's tables
    assert "aten.item" not in seen.ops and "aten._local_scalar_dense" not in seen.ops   # no value read on the host
