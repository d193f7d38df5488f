"""Rotary position embedding tables (HF's rotate-half layout; `fused_ops.rotary` applies them),
with optional llama3 frequency scaling."""

from __future__ import annotations

import math
from typing import Any

import torch


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Long wavelengths (beyond the original context) are slowed by `factor`, short ones kept,
    # and the band between is interpolated smoothly.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original_len / low, inv_freq / factor, inv_freq)
    smooth = (original_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= original_len / high) & (wavelen <= original_len / low)
    return torch.where(in_band, blended, scaled)


class RotaryEmbedding:
    """cos/sin for the given positions; computed per forward (cheap) instead of a table sized
    by max_position_embeddings, which is large for long-context models."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None,
                 device: torch.device) -> None:
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float()
        inv_freq = 1.0 / (theta ** (exponents / head_dim))
        if scaling is not None:
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        self.inv_freq = inv_freq  # (head_dim / 2,) fp32

    def cos_sin(self, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(num_tokens, 1, head_dim) cos and sin, broadcastable over heads."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # (T, D/2)
        angles = torch.cat((angles, angles), dim=-1)[:, None, :]  # (T, 1, D)
        return angles.cos().to(dtype), angles.sin().to(dtype)
