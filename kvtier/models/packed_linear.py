"""Linear layers whose bf16 weights are packed once, after loading, for the CPU kernel that runs
them: kvtier's AMX tiles where the CPU has them, else oneDNN's blocked layout.

`F.linear` on a plain bf16 CPU weight is up to twice as slow for the few rows of a decode
step as the same product on a weight oneDNN has packed ahead of time (SmolLM2-135M on 2 cores:
a 3072x576 projection over 20 rows 267 vs 215 us, over 1 row 136 vs 67 us; its 49152x576 logits
head over 20 rows 7.7 vs 3.9 ms; all of a 528-token prefill's projections 345 vs 310 ms): the
packed one does not prepare the weight on each call. On a CPU with AMX (Intel Sapphire Rapids
and later) kvtier's own tile kernel (`amx_linear`, kvtier/models/csrc/linear_amx.cpp) streams
the weights faster still (docs/benchmarks.md, "Packed projections"). Either way the plain copy
is dropped, except for a logits head tied to the embeddings, which keeps both.
"""

from __future__ import annotations

import torch
from torch import nn

from kvtier.models import cpu_kernels

# The AMX kernel's tiles: 16 output columns by 32 input columns.
AMX_COLUMNS, AMX_DEPTH = 16, 32
# Steps of up to this many rows (decode batches) run the AMX kernel; longer ones (prefill chunks)
# oneDNN's, which multiplies 2,048 rows up to a fifth faster.
AMX_MAX_ROWS = 256


def can_pack(weight: torch.Tensor) -> bool:
    """True where packed kernels exist and win: bf16 weights on a CPU with oneDNN."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def amx_kernels():
    """torch.ops.kvtier where its AMX linear runs on this CPU, else None."""
    kernels = cpu_kernels.ops()
    return kernels if kernels is not None and kernels.amx_linear_supported() else None


def pack_for_amx(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) -> (N/16, K/32, 16, 16, 2): per block of 16 output columns, its K/32 tiles in
    order, each 16 pairs of input columns by the 16 output columns by the pair."""
    n, k = weight.shape
    tiles = weight.detach().reshape(n // AMX_COLUMNS, AMX_COLUMNS, k // AMX_DEPTH,
                                    AMX_DEPTH // 2, 2)
    return tiles.permute(0, 2, 3, 1, 4).contiguous()


class PackedLinear(nn.Module):
    """`F.linear(x, weight, bias)` over a weight packed for the AMX kernel (where it runs and
    the shape fits its tiles) or for oneDNN (see can_pack)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 kernel: str = "auto") -> None:
        """kernel: "auto" (AMX where it runs and the shape fits its tiles, else oneDNN), "amx"
        or "onednn" (benchmarks and tests compare them)."""
        super().__init__()
        if kernel not in ("auto", "amx", "onednn"):
            raise ValueError(f"kernel must be 'auto', 'amx' or 'onednn', not {kernel!r}")
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach()
        fits = self.out_features % AMX_COLUMNS == 0 and self.in_features % AMX_DEPTH == 0
        self.amx = amx_kernels() if fits and kernel != "onednn" else None
        if kernel == "amx" and self.amx is None:
            raise ValueError(f"no AMX linear for a {self.out_features}x{self.in_features} "
                             "weight here (AMX bf16 tiles, N % 16 == 0, K % 32 == 0)")
        self.max_amx_rows = AMX_MAX_ROWS if kernel == "auto" else None
        self.amx_packed = None if self.amx is None else pack_for_amx(weight)
        self.packed = None  # oneDNN's; "auto" keeps both, for the longer steps
        if self.amx is None or kernel == "auto":
            # None: no batch-size hint; measured as fast as a hint for 1 to 1,100 rows.
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.amx is None or (self.max_amx_rows is not None and rows > self.max_amx_rows):
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        out = self.amx.amx_linear(x.reshape(rows, self.in_features), self.amx_packed, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, kernel={'amx' if self.amx else 'onednn'}")


def pack_linears(module: nn.Module) -> None:
    """Replace every packable nn.Linear under `module` by a PackedLinear."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear) and can_pack(child.weight):
            setattr(module, name, PackedLinear(child.weight, child.bias))
        else:
            pack_linears(child)
