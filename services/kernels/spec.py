"""What native code epd builds at install, for which instruction sets: read by setup.py and by the loader.

This module is the one table both sides share, so it imports nothing outside the standard library (the
build backend loads it by path, before epd or torch can be imported).

A `Kernel` is one C source (in this folder) built into one shared library per `Variant` it lists; a
variant is an instruction set: the compiler flags that let the compiler use it and the CPU features
(as Linux names them in /proc/cpuinfo) a machine must have to run that library.  The loader
(services/kernels/loader.py) picks, at run time, the first variant of `Kernel.variants` (best first) the
CPU has; a kernel whose every variant needs features the CPU lacks is "unsupported" and its caller takes
torch's path.  A variant's flags never name the build machine's own CPU (compiling for it is what made a
shared cache hand AVX-512 code to an AVX2 host): a wheel built on any x86-64 machine runs on every other one.

x86 variants are built only where the compiler targets x86-64; "portable" everywhere (aarch64 included),
with the architecture's baseline (SSE2 on x86-64, NEON on aarch64).
"""

from __future__ import annotations

from dataclasses import dataclass

X86 = ("x86_64", "amd64")


@dataclass(frozen=True)
class Variant:
    name: str
    features: tuple[str, ...]      # /proc/cpuinfo flags the CPU must have
    flags: tuple[str, ...]         # compiler flags beyond the baseline
    machines: tuple[str, ...] = X86   # platform.machine() values it is built for; () = every machine


_AVX2 = ("avx2", "fma")
_AVX512 = (*_AVX2, "avx512f", "avx512bw", "avx512dq", "avx512vl")
VARIANTS = {
    "portable": Variant("portable", (), (), ()),
    "avx2": Variant("avx2", _AVX2, ("-mavx2", "-mfma")),
    "avx512": Variant("avx512", _AVX512, ("-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl")),
    "avx512_vnni": Variant("avx512_vnni", (*_AVX512, "avx512_vnni"),
                           ("-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512vnni")),
    "avx512_bf16": Variant("avx512_bf16", (*_AVX512, "avx512_bf16"),
                           ("-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512bf16")),
}
# The baseline every build of a machine starts from, so a CFLAGS naming the build machine's own CPU in the environment
# (an earlier flag; the last -march wins) cannot leak the build machine's CPU into a "portable" library.
BASELINE = {"x86_64": ("-march=x86-64", "-mtune=generic"), "amd64": ("-march=x86-64", "-mtune=generic"),
            "aarch64": ("-march=armv8-a",), "arm64": ("-march=armv8-a",)}
# -fno-wrapv undoes Python's own CFLAGS (-fwrapv), which keeps loops with int counters from vectorizing.
COMMON_FLAGS = ("-O3", "-fno-wrapv", "-g0")


@dataclass(frozen=True)
class Kernel:
    name: str
    source: str                    # file in services/kernels/
    variants: tuple[str, ...]      # best first
    flags: tuple[str, ...] = ()
    defines: tuple[str, ...] = ()
    includes: tuple[str, ...] = ()  # other files of this folder the source #includes (rebuild when they change)
    openmp: bool = False           # linked with libgomp: the loader imports torch first, so torch's copy is the one
    libs: tuple[str, ...] = ("m",)
    fallback: str = "torch's path"  # what runs where no variant does (docs/deployment.md's table)

    def library(self, variant: str) -> str:
        """The module name of one variant's library inside services.kernels."""
        return f"_{self.name}_{variant}"


_FAST_MATH = ("-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math")
KERNELS = {k.name: k for k in (
    Kernel("shm_fence", "shm_fence.c", ("portable",), libs=(), fallback="none: the shm connector refuses to start"),
    Kernel("resize", "resize.c", ("avx2", "portable"), libs=(), fallback="numpy"),
    Kernel("panel", "panel.c", ("avx512", "avx2"), ("-fopenmp",), openmp=True, fallback="oneDNN or F.linear"),
    Kernel("panel_bf16", "panel.c", ("avx512_bf16", "avx512", "avx2"), ("-fopenmp",), ("EPD_PANEL_BF16",),
           openmp=True, fallback="oneDNN or F.linear"),
    Kernel("fused_step", "fused_step.c", ("avx512", "avx2"), ("-fopenmp",), includes=("paged_attention.c", "panel.c"),
           openmp=True, fallback="the eager step"),
    Kernel("fused_step_bf16", "fused_step.c", ("avx512", "avx2"), ("-fopenmp",), ("EPD_PANEL_BF16",),
           includes=("paged_attention.c", "panel.c"), openmp=True, fallback="the eager step"),
    Kernel("prefill_attention", "prefill_attention.c", ("avx512",), ("-fopenmp",), openmp=True, fallback="SDPA"),
    Kernel("head_int8", "head_int8.c", ("avx512_vnni",), ("-fopenmp",), openmp=True,
           fallback="the bfloat16 screen"),
)}
# Names EPD_KERNELS_OFF (and --kernels-off) accept for a pair built from one source.
FAMILIES = {"panel": ("panel", "panel_bf16"), "fused_step": ("fused_step", "fused_step_bf16")}


def builds(machine: str) -> list[tuple[Kernel, Variant]]:
    """Every (kernel, variant) a build on `machine` (platform.machine()) produces."""
    machine = machine.lower()
    out = []
    for kernel in KERNELS.values():
        for name in kernel.variants:
            variant = VARIANTS[name]
            if not variant.machines or machine in variant.machines:
                out.append((kernel, variant))
    return out


def compile_flags(kernel: Kernel, variant: Variant, machine: str) -> list[str]:
    """The compiler flags of one library (after Python's own CFLAGS, which they override)."""
    return [*COMMON_FLAGS, *BASELINE.get(machine.lower(), ()), *variant.flags, *kernel.flags,
            *(f"-D{define}" for define in kernel.defines)]
