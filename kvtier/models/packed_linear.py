"""Linear layers whose weights are packed once into oneDNN's blocked layout (CPU, bfloat16).

`F.linear` on a plain bf16 CPU weight is up to twice as slow for the few rows of a decode
step as the same product on a weight oneDNN has packed ahead of time (SmolLM2-135M on 2 cores:
a 3072x576 projection over 20 rows 267 vs 215 us, over 1 row 136 vs 67 us; its 49152x576 logits
head over 20 rows 7.7 vs 3.9 ms; all of a 528-token prefill's projections 345 vs 310 ms). The
products are the same: both run oneDNN's bf16 kernels, the packed one without preparing the
weight on each call. Packing happens after the weights are loaded; the plain copy is dropped,
except for a logits head tied to the embeddings, which keeps both.
"""

from __future__ import annotations

import torch
from torch import nn


def can_pack(weight: torch.Tensor) -> bool:
    """True where the packed kernels exist and win: bf16 weights on a CPU with oneDNN."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """`F.linear(x, weight, bias)` over a weight packed for oneDNN (see can_pack)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        # None: no batch-size hint; measured as fast as a hint for 1 to 1,100 rows.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


def pack_linears(module: nn.Module) -> None:
    """Replace every packable nn.Linear under `module` by a PackedLinear."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear) and can_pack(child.weight):
            setattr(module, name, PackedLinear(child.weight, child.bias))
        else:
            pack_linears(child)
