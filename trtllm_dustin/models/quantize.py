"""Weight-only int8 for drafters: each projection keeps an int8 weight and one fp32 scale per output row.

A drafter's proposals are verified by the target, so a drafter may be approximate without making decoding inexact:
quantizing its weights changes how often proposals are accepted (tau), never which tokens are committed. A drafter's
round reads its weights once per slot (seven times a round for the ring drafter at Γ = 7), so at decode batch
sizes its projections are weight streams, and int8 halves their bytes. The target is never quantized here.

Rounding is symmetric per output row: scale = max |w| / 127 and q = round(w / scale), so every row's largest weight
is exact and the error of any weight is at most scale / 2. On the fused path (`project`) the skinny-M kernel reads
the int8 weight as it lies (plugins/skinny_linear.py); the module code (`Int8Linear.forward`) widens it first.

Wide calls: reading int8 costs the kernel a widening of each weight tile before its MMA, which a weight stream of a
few rows hides and a call of many rows does not (the H200 sweep: 188 against 136 us per Llama-8B-width layer at 128
rows, `benchmarks/results/longspark2/README.md`, eighth step). A drafter quantized while `KernelConfig.int8_wide` is on
keeps a copy of each dequantized weight in the model's dtype (`Int8Linear.keep_wide`), and `project` runs calls of
more than INT8_WIDE_ROWS rows on it through cuBLAS; the few-row calls (slot steps) still read int8.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trtllm_dustin.config import ConfigError
from trtllm_dustin.plugins.kernel_config import KernelConfig
from trtllm_dustin.plugins.skinny_linear import SplitKWorkspace, skinny_linear, skinny_linear_ref

__all__ = ["DRAFTER_WEIGHTS", "INT8_WIDE_ROWS", "Int8Linear", "check_drafter_weights", "project", "quantize_draft",
           "quantize_int8", "quantize_linears", "quantize_rows"]

DRAFTER_WEIGHTS = ("model", "int8")  # --ring-weights / --draft-weights: the model's own dtype, or weight-only int8
INT8_WIDE_ROWS = 64  # calls of more rows take an Int8Linear's wide copy, where it has one (KernelConfig.int8_wide)


class Int8Linear(nn.Module):
    """y = x @ (scale[:, None] * weight)^T + bias, with weight int8 [N, K] and scale fp32 [N] (buffers, so `.to`
    moves them and leaves the int8 weight int8)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        if weight.dtype != torch.int8 or weight.dim() != 2 or tuple(scale.shape) != (weight.shape[0],):
            raise ValueError(f"Int8Linear takes an int8 weight [N, K] and a scale [N]; got {weight.dtype} "
                             f"{tuple(weight.shape)} and {tuple(scale.shape)}")
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("scale", scale.float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        # keep_wide: the dequantized weight in a float dtype, for wide calls (derived, so never in a state dict)
        self.register_buffer("wide", None, persistent=False)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return skinny_linear_ref(x, self.weight, self.bias, self.scale)

    def dequantized(self) -> torch.Tensor:
        """The weight it stands for, fp32 [N, K]."""
        return self.weight.float() * self.scale[:, None]

    def keep_wide(self, dtype: torch.dtype) -> Int8Linear:
        """Keep the dequantized weight in `dtype` beside the int8 one (on the int8 weight's device), for the fused
        path's calls of more than INT8_WIDE_ROWS rows (`project`). The copy holds dtype-sized weights again: 2 bytes
        per weight in bf16, on top of the int8 byte."""
        if not dtype.is_floating_point:
            raise ValueError(f"Int8Linear.keep_wide takes a float dtype (the model's), got {dtype}")
        self.wide = self.dequantized().to(dtype).contiguous()
        return self

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (int8 [N, K], fp32 scale [N]) on its device, rounded per row (symmetric; a row of zeros
    gets scale 1)."""
    w = weight.detach().float()
    peak = w.abs().amax(dim=1)
    scale = torch.where(peak > 0, peak / 127, torch.ones_like(peak))
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous(), scale


def quantize_int8(linear: nn.Linear) -> Int8Linear:
    """An nn.Linear's weight rounded to int8 per output row (quantize_rows); the bias is kept as it is."""
    q, scale = quantize_rows(linear.weight)
    return Int8Linear(q, scale, None if linear.bias is None else linear.bias.detach())


def quantize_linears(module: nn.Module, wide: torch.dtype | None = None) -> int:
    """Replace every nn.Linear inside `module` (not `module` itself) by its Int8Linear, each keeping a wide copy in
    dtype `wide` if one is given (Int8Linear.keep_wide); returns how many."""
    found = [(name, child) for name, child in module.named_modules() if isinstance(child, nn.Linear) and name]
    for name, child in found:
        parent_name, _, attr = name.rpartition(".")
        int8 = quantize_int8(child)
        if wide is not None:
            int8.keep_wide(wide)
        setattr(module.get_submodule(parent_name) if parent_name else module, attr, int8)
    return len(found)


def quantize_draft(model: nn.Module, kind: str) -> nn.Module:
    """A draft Transformer served with `kind` weights: "int8" rounds the projections of every layer (the embedding,
    the final norm and the output head stay), "model" leaves it as it is. Returns the model."""
    if check_drafter_weights(kind) == "int8":
        for layer in model.layers:
            quantize_linears(layer)
    return model


def project(layer: nn.Module, x: torch.Tensor, kernels: KernelConfig,
            workspace: SplitKWorkspace | None = None) -> torch.Tensor:
    """layer(x) on the fused decode path: the skinny-M GEMM with the layer's weight as it is stored (an Int8Linear's
    int8 weight and scales; an nn.Linear's weight in the model's dtype). An Int8Linear called with more than
    INT8_WIDE_ROWS rows, with `kernels.int8_wide` on, takes cuBLAS on its wide copy where it keeps one."""
    scale = None
    if isinstance(layer, Int8Linear):
        if layer.wide is not None and kernels.int8_wide and x.numel() > INT8_WIDE_ROWS * x.shape[-1]:
            return F.linear(x, layer.wide, layer.bias)
        scale = layer.scale
    return skinny_linear(x, layer.weight, layer.bias, workspace, kernels=kernels, scale=scale)


def check_drafter_weights(kind: str) -> str:
    if kind not in DRAFTER_WEIGHTS:
        raise ConfigError(f"drafter weights {kind!r}: choose one of {', '.join(DRAFTER_WEIGHTS)} (model: the model's "
                          "own dtype; int8: weight-only int8, one scale per output row)")
    return kind
