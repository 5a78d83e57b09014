"""Fused MLPs and a GEMM patch embedding for the many-row forwards (prefill's stack, the vision tower).

Why: a prefill or vision forward runs its MLP as three GEMMs and, between them, element-wise ops
over the [rows, intermediate] activations that each read and write the whole tensor through a fresh
allocation (SiLU, the gate * up product; quick_gelu's scale, sigmoid and product).  With
oneDNN-prepacked weights (services/models/prepack.py) they fold into the GEMMs' post-ops
(`python -m benchmarks.fused_mlp` times both on the medium Qwen2-VL: docs/benchmarks.md):

- gated SiLU MLP (Llama, Qwen2, Qwen2.5-VL's vision): `gate = linear(x, Wg) -> swish` (oneDNN's
  eltwise post-op, alpha 1 = SiLU) and `h = linear(x, Wu) * gate` (a binary post-op), then `down(h)`:
  no separate activation or product pass;
- fc1 -> act -> fc2 (Qwen2-VL's and CLIP's vision): the activation runs in place on fc1's output
  (quick_gelu: one scratch tensor instead of three), then fc2.

And the Qwen-VL patch embedding, a Conv3d whose kernel equals its stride over inputs already cut
into single patches, is the GEMM it is: `pixels[N, C*T*P*P] @ W[E, C*T*P*P]^T` (mkldnn's 3-D
convolution spent ~6 ms on 256 patches, the GEMM ~1 ms; oneDNN's prepacked GEMM 0.63 ms against
F.linear's 1.45 ms at 256 x 1176 -> 512 on this project's AMD box).

`fuse_mlps(root, mode, rows)` runs before the per-shape kernel decision of prepack.py: a gated MLP
becomes a `FusedGatedMLP` over its own prepacked linears (in auto mode when timing the MLP as a unit
says so: the fusion is part of what oneDNN buys, which per-GEMM timing does not see), an fc1/act/fc2
MLP an `InPlaceActMLP` whose fc1 and fc2 are then decided with the other linears.
`gemm_patch_embeds(root)` swaps the patch embeddings.  The swaps keep one copy of each weight.  Outputs
agree with the unfused modules to float32 rounding (tests: <= 1e-5 relative, same greedy tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from services.models.packed_linear import PackedLinear, bf16_packable, pack_weight

_LP = None


def _lp() -> Any:
    global _LP
    if _LP is None:
        _LP = torch.ops.mkldnn._linear_pointwise
    return _LP


def _act_name(act: Any) -> str:
    """'silu', 'quick_gelu', 'gelu' (exact, erf) or '' for an activation module we do not fuse."""
    from transformers.activations import GELUActivation, QuickGELUActivation, SiLUActivation

    if isinstance(act, (SiLUActivation, nn.SiLU)):
        return "silu"
    if isinstance(act, QuickGELUActivation):
        return "quick_gelu"
    if isinstance(act, nn.GELU) and act.approximate == "none":
        return "gelu"
    if type(act) is GELUActivation and getattr(act, "act", None) is nn.functional.gelu:
        return "gelu"
    return ""


class FusedGatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with the SiLU and the product as oneDNN post-ops of the two GEMMs."""

    def __init__(self, gate: PackedLinear, up: PackedLinear, down: nn.Module) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate, up, down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lp = _lp()
        x = x.contiguous()
        gate = lp(x, self.gate_proj.weight, self.gate_proj.bias, "swish", [], "")
        return self.down_proj(lp.binary(x, gate, self.up_proj.weight, self.up_proj.bias, "mul"))


class InPlaceActMLP(nn.Module):
    """fc2(act(fc1(x))) with the activation computed in place on fc1's output."""

    def __init__(self, fc1: nn.Module, fc2: nn.Module, act: str) -> None:
        super().__init__()
        self.fc1, self.fc2, self.act_name = fc1, fc2, act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.fc1(x)
        if self.act_name == "quick_gelu":
            hidden.mul_(torch.mul(hidden, 1.702).sigmoid_())
        elif self.act_name == "silu":
            nn.functional.silu(hidden, inplace=True)
        else:
            hidden = nn.functional.gelu(hidden)
        return self.fc2(hidden)


def _gated(module: nn.Module) -> bool:
    """A gate/up/down MLP with SiLU whose three linears are plain CPU `nn.Linear`s oneDNN packs."""
    from services.models.packed_linear import can_pack

    names = dict(module.named_children())
    return (not isinstance(module, FusedGatedMLP)
            and all(can_pack(names.get(n)) for n in ("gate_proj", "up_proj", "down_proj"))
            and _act_name(getattr(module, "act_fn", None)) == "silu")


def _fc_act(module: nn.Module) -> str:
    """The activation of an fc1 -> act -> fc2 MLP ('' when `module` is not one)."""
    names = dict(module.named_children())
    if isinstance(module, InPlaceActMLP) or not {"fc1", "fc2"} <= names.keys():
        return ""
    return _act_name(getattr(module, "act", None) or getattr(module, "activation_fn", None))


def packed_gated(mlp: Any) -> FusedGatedMLP:
    return FusedGatedMLP(PackedLinear(mlp.gate_proj), PackedLinear(mlp.up_proj), PackedLinear(mlp.down_proj))


@dataclass
class FuseReport:
    gated: int = 0                  # gate/up/down MLPs swapped for FusedGatedMLP
    in_place: int = 0               # fc1/act/fc2 MLPs swapped for InPlaceActMLP
    speedup: float | None = None    # auto: F.linear MLP time / fused time (gated MLPs, at the rows)
    max_rel_diff: float | None = None
    reason: str = ""

    @property
    def count(self) -> int:
        return self.gated + self.in_place


def fuse_mlps(root: nn.Module, mode: str = "prepacked", rows: tuple[int, ...] = (256,)) -> FuseReport:
    """Swap the MLPs under `root` for fused ones.  fc1/act/fc2 MLPs (any kernel) unless mode is "default";
    gated SiLU MLPs of plain linears when mode is "prepacked", or "auto" and timing them at `rows` (up to
    four layers in turn) finds the fused one at least 1.05x faster with outputs within 1e-4 relative."""
    from services.models import kernel_choices, packed_linear

    report = FuseReport()
    if mode == "default":
        return report
    found: list[tuple[nn.Module, str, Any]] = [(parent, name, child) for parent in root.modules()
                                               for name, child in parent.named_children()]
    for parent, name, child in found:
        if act := _fc_act(child):
            setattr(parent, name, InPlaceActMLP(child.fc1, child.fc2, act))
            report.in_place += 1
    gated = [(parent, name, child) for parent, name, child in found if _gated(child)]
    if not gated or mode == "panel" or not torch.backends.mkldnn.is_available():
        return report
    if mode == "auto":
        from services.hostcpu import compute_threads

        sample: list[Any] = [child for _, _, child in gated[:4]]

        def timed() -> tuple[list[float], float]:
            ratios, worst = [], 0.0
            with torch.inference_mode():
                for count in rows:
                    weight = sample[0].gate_proj.weight
                    x = torch.randn(count, weight.shape[1], dtype=weight.dtype)
                    candidates: dict[str, list[nn.Module]] = {"default": sample,
                                                              "fused": [packed_gated(m) for m in sample]}
                    best, diffs = packed_linear._compare(candidates, x)
                    ratios.append(best["default"] / best["fused"])
                    worst = max(worst, diffs["fused"])
            return ratios, worst

        gate, down = sample[0].gate_proj, sample[0].down_proj
        what = {"rows": list(rows), "gate": list(gate.weight.shape), "down": list(down.weight.shape),
                "bias": gate.bias is not None, "layers": len(sample), "dtype": str(gate.weight.dtype)}

        def measure() -> dict[str, Any]:
            ratios, worst = compute_threads.run_in_fresh_thread(timed)
            return {"ratios": ratios, "worst": worst}

        decision, _ = kernel_choices.decided(
            "fused_mlp", what, measure,
            valid=lambda kept: set(kept) == {"ratios", "worst"} and len(kept["ratios"]) == len(rows))
        ratios, worst = decision["ratios"], float(decision["worst"])
        report.speedup, report.max_rel_diff = packed_linear._geomean(ratios), worst
        too_far = worst > packed_linear.tolerance(sample[0].gate_proj.weight.dtype)
        if too_far or report.speedup < packed_linear.MIN_SPEEDUP:
            report.reason = f"fused MLP {report.speedup:.2f}x, outputs differ by {worst:.1e} relative: not used"
            return report
    for parent, name, child in gated:
        setattr(parent, name, packed_gated(child))
    report.gated = len(gated)
    return report


PATCH_ROWS = 256  # patches per GEMM of GemmPatchEmbed


class GemmPatchEmbed(nn.Module):
    """A Qwen-VL patch embedding (Conv3d, kernel == stride, one patch per input row) as GEMMs of a fixed
    PATCH_ROWS rows (the last zero-padded): a multi-threaded GEMM splits its work by its shape, so one GEMM
    over a forward's patches gave an image other floats (~1e-6) batched with others than alone; with
    fixed-shape GEMMs an image embeds to the same bits in any batch, as the convolution's did."""

    def __init__(self, embed: Any) -> None:
        super().__init__()
        conv = embed.proj
        self.embed_dim = int(conv.out_channels)
        self.patch_dim = int(conv.weight[0].numel())
        weight = conv.weight.detach().reshape(self.embed_dim, self.patch_dim)
        # oneDNN's blocked layout where it takes the weight (its AVX-512 GEMM: ~0.4x F.linear's time here, whose
        # BLAS runs AVX2 code on AMD CPUs); the packed tensor is then the one copy (its dtype reads as the weight's)
        self.packed = torch.backends.mkldnn.is_available() and weight.device.type == "cpu" and (
            weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and bf16_packable()))
        self.weight = (pack_weight(weight, PATCH_ROWS) if self.packed
                       else nn.Parameter(weight, requires_grad=False))
        self.bias = None if conv.bias is None else nn.Parameter(conv.bias.detach(), requires_grad=False)
        # transformers reads these of a patch embedding
        self.patch_size, self.temporal_patch_size = embed.patch_size, embed.temporal_patch_size
        self.in_channels = embed.in_channels
        self.proj = _WeightView(self.weight)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        pixels = hidden_states.reshape(-1, self.patch_dim).to(self.weight.dtype)
        out = pixels.new_empty(pixels.shape[0], self.embed_dim)
        for start in range(0, pixels.shape[0], PATCH_ROWS):  # every GEMM the same shape (docstring)
            part = pixels[start:start + PATCH_ROWS]
            if part.shape[0] < PATCH_ROWS:
                part = torch.cat([part, part.new_zeros(PATCH_ROWS - part.shape[0], self.patch_dim)])
            gemm = (_lp()(part.contiguous(), self.weight, self.bias, "none", [], "") if self.packed
                    else nn.functional.linear(part, self.weight, self.bias))
            out[start:start + PATCH_ROWS] = gemm[:out.shape[0] - start]
        return out


class _WeightView(nn.Module):
    """`patch_embed.proj.weight.dtype` still answers (transformers' vision towers read it)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self._weight = [weight]   # not registered twice

    @property
    def weight(self) -> torch.Tensor:
        return self._weight[0]


def _is_patchify(embed: nn.Module) -> bool:
    conv = getattr(embed, "proj", None)
    if not isinstance(conv, nn.Conv3d) or not all(hasattr(embed, a) for a in
                                                   ("patch_size", "temporal_patch_size", "in_channels")):
        return False
    kernel = (embed.temporal_patch_size, embed.patch_size, embed.patch_size)
    return (tuple(conv.kernel_size) == kernel and tuple(conv.stride) == kernel and conv.groups == 1
            and tuple(conv.padding) == (0, 0, 0) and tuple(conv.dilation) == (1, 1, 1)
            and conv.in_channels == embed.in_channels)


def gemm_patch_embeds(root: nn.Module) -> int:
    """Swap every Qwen-VL-style patch embedding under `root` for its GEMM; the count swapped."""
    swaps = [(parent, name, child) for parent in root.modules() for name, child in parent.named_children()
             if _is_patchify(child)]
    for parent, name, child in swaps:
        setattr(parent, name, GemmPatchEmbed(child))
    return len(swaps)
