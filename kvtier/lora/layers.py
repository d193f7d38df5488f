"""Projections that add each request's adapter to their output, several adapters in one batch.

`attach_lora` wraps every target module once; a step's `LoRABatch.begin_step` says which rows
of the batch run which adapter. Rows without one cost nothing; a step without adapters costs
one check per projection.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.lora.adapter import LoRAAdapter
from kvtier.lora.targets import LoRATarget


class LoRABatch:
    """This step's adapters and the batch rows (tokens) each one runs on."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # (adapter, its rows: None for every row of the batch, else (R,) indices)
        self.groups: list[tuple[LoRAAdapter, torch.Tensor | None]] = []

    def begin_step(self, adapters: Sequence[LoRAAdapter | None],
                   query_start: Sequence[int]) -> None:
        """`adapters[i]`: request i's adapter, whose tokens are rows
        [query_start[i], query_start[i + 1])."""
        # By content: one adapter loaded under two names runs once over both names' rows.
        ranges: dict[str, tuple[LoRAAdapter, list[range]]] = {}
        for index, adapter in enumerate(adapters):
            if adapter is not None:
                rows = range(query_start[index], query_start[index + 1])
                ranges.setdefault(adapter.cache_key, (adapter, []))[1].append(rows)
        self.groups = []
        total = query_start[len(adapters)]
        for adapter, pieces in ranges.values():
            if sum(len(rows) for rows in pieces) == total:
                self.groups.append((adapter, None))
                continue
            rows = torch.tensor([row for piece in pieces for row in piece], dtype=torch.long)
            self.groups.append((adapter, rows.to(self.device)))

    def end_step(self) -> None:
        self.groups = []


class LoRALinear(nn.Module):
    """`base(x)` plus, for each adapter of the step that adapts this module, its product on
    that adapter's rows (within the output rows of each adapted piece)."""

    def __init__(self, base: nn.Module, path: str, batch: LoRABatch) -> None:
        super().__init__()
        self.base = base
        self.path = path
        self.batch = batch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)  # (T, out_features)
        for adapter, rows in self.batch.groups:
            weights = adapter.weights.get(self.path)
            if weights is None:
                continue
            if rows is None:
                # out += scaling * (x A^T) B^T, accumulated in place.
                out.addmm_(F.linear(x, weights.lora_a), weights.lora_b.t(),
                           alpha=weights.scaling)
            else:
                delta = F.linear(F.linear(x[rows], weights.lora_a), weights.lora_b)  # (R, out)
                out.index_add_(0, rows, delta, alpha=weights.scaling)
        return out


def attach_lora(model: nn.Module, targets: dict[str, LoRATarget],
                device: torch.device) -> LoRABatch:
    """Wrap every module the targets name; returns the batch state they share."""
    batch = LoRABatch(device)
    for path in sorted({target.module for target in targets.values()}):
        parent_path, _, attribute = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        setattr(parent, attribute, LoRALinear(getattr(parent, attribute), path, batch))
    return batch
