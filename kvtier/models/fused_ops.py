"""The decoder's elementwise ops, fused in C++ on the CPU (kvtier/models/csrc/fused_ops.cpp)
and plain torch elsewhere or when the kernels are unavailable. Both paths round intermediates to
the model dtype at the same points (the torch code below is the definition), so they agree to
the last bit but for the order of one fp32 sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvtier.models import cpu_kernels


def _kernels(x: torch.Tensor):
    return cpu_kernels.ops() if x.device.type == "cpu" else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rms_norm(x) over the last dim: normalised in fp32 and rounded, then scaled in the
    model dtype, as HF's Llama does."""
    kernels = _kernels(x)
    if kernels is not None:
        return kernels.rms_norm(x.contiguous(), weight, eps)
    return weight * F.rms_norm(x, weight.shape, eps=eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """(..., 2n) [gate | up] -> silu(gate) * up, (..., n)."""
    kernels = _kernels(x)
    if kernels is not None:
        return kernels.silu_and_mul(x.contiguous())
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding: x (T, heads, D); cos, sin (T, 1, D) in x's dtype."""
    kernels = _kernels(x)
    if kernels is not None:
        # x as it is: the kernel reads a strided view of the qkv projection in place.
        return kernels.rotary(x, cos.contiguous(), sin.contiguous())
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
