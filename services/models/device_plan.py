"""What a model role runs where, decided once from --device: the CPU machinery is never reached on CUDA.

CPU-only here: the C kernels built with gcc (panel linears, the fused decode step, prefill attention, the int8 /
bfloat16 LM head screen), oneDNN's packed weights and fused MLPs / patch-embedding GEMM
(`torch.ops.mkldnn.*`, which have no CUDA kernels: `_reorder_linear_weight` on a CUDA weight crashes), and the
process knobs of role_cpu (OpenMP teams and spinning, niceness, the compute lease encode and prefill share, the
long-prompt board).  `plan_for(config)` is the one place that decides; the role apps (services/{encode,prefill,
decode}/app.py) and `role_main` build everything from its fields and test nothing about the device themselves.
tests/services/test_device_plan.py checks the CUDA plan on the "meta" device: no CPU-only op is dispatched and
no CPU-only entry point is called.

On CUDA, "auto" choices mean off; an explicit CPU-only choice (--linear-kernel panel|prepacked, --decode-fused
on, --lm-head-screen on) is refused with the reason (checked by the
config itself), never silently ignored.  CUDA's own decode step is services/decode/gpu_runner.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.config.checks import cpu_only_on_cuda

if TYPE_CHECKING:
    from services.config import EpdConfig

@dataclass(frozen=True)
class DevicePlan:
    device: str
    cpu: bool                 # the CPU path; False: CUDA
    linear_kernel: str        # services/models/prepack.py mode: --linear-kernel on CPU, "default" on CUDA
    fused_kernels: bool       # prefill's fused MLPs, encode's patch-embedding GEMM and MLPs
    native_attention: bool    # prefill's AVX-512 attention kernel (services/models/attention_kernel.py)
    decode_fused: str         # services/decode/fused.py mode ("off" on CUDA)
    lm_head_screen: str       # services/models/head_screen.py mode ("off" on CUDA)
    decode_attention: str     # CPU: "auto" (grouped SDPA, services/decode/attention.py); CUDA: "flex" (flex_paged.py)
    cpu_knobs: bool           # role_cpu.apply and the boards `epd serve` hands out (threads, nice, lease)


def is_cuda(device: object) -> bool:
    """A torch device (or its name) of CUDA type."""
    return str(device).split(":")[0] == "cuda"


def plan_for(config: EpdConfig) -> DevicePlan:
    """The plan of a model role process; ValueError where the config asks a CPU-only kernel on CUDA (the config
    refuses such a config when it is made: services/config/checks.py cpu_only_on_cuda)."""
    device, engines = config.checkpoint.device, config.engines
    reason = cpu_only_on_cuda(device, engines)
    if reason:
        raise ValueError(reason)
    if is_cuda(device):
        return DevicePlan(device, False, "default", False, False, "off", "off", "flex", False)
    return DevicePlan(device, True, engines.linear_kernel, engines.linear_kernel != "default", True,
                      engines.decode_fused, engines.lm_head_screen, "auto", True)
