"""Linear layers over oneDNN's prepacked weights, for models served on a CPU in float32 (eager).

The default CPU GEMM costs a few rows nearly as many times one row, and a verify of K+1 tokens, or a
draft's steps for a few sessions, is a few rows. With the weight packed once the GEMM reads it about
once (docs/benchmarks.md, "Prepacked CPU weights"). Inductor's
freezing and vLLM's CPU backend do the same; a compiled model packs its own. Also `concatenated`, the one
product of several projections of one input (target_server/native.py: fuse_projections). Imported by the
services only (torch at import)."""

from __future__ import annotations

import torch
from torch import nn

# Below this many weights oneDNN's call costs more than the GEMM saves: the demo target (hidden 192) decoded
# slower with every projection packed than with none.
PACK_MIN_WEIGHTS = 1 << 18


class PackedLinear(nn.Module):
    """nn.Linear's product over the packed weight; the original weight is not kept."""

    def __init__(self, linear: nn.Linear, rows: int = 8):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows)
        self.register_buffer("packed", packed, persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return torch.device(device).type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def pack_linears(model: nn.Module) -> int:
    """Every nn.Linear in `model` of at least PACK_MIN_WEIGHTS weights becomes a PackedLinear, in place
    (inference only: the packed weight is a copy, not a parameter). Returns how many."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is nn.Linear and child.weight.numel() >= PACK_MIN_WEIGHTS]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)


def concatenated(*linears: nn.Module) -> nn.Linear:
    """One nn.Linear whose output is the given nn.Linears' outputs one after another (same input): q, k, v or
    gate, up as one product, as vLLM's QKVParallelLinear and MergedColumnParallelLinear are. On a CPU a
    product of a few rows costs mostly its call."""
    weight = torch.cat([linear.weight for linear in linears])
    bias = linears[0].bias is not None
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=bias, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if bias:
        fused.bias = nn.Parameter(torch.cat([linear.bias for linear in linears]), requires_grad=False)
    return fused
