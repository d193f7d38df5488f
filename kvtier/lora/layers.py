"""Projections that add each request's adapter to their output, several adapters in one batch.

`attach_lora` wraps every target module once; a step's `LoRABatch.begin_step` says which rows
of the batch run which adapter. Rows without one cost nothing; a step without adapters costs
one check per projection. One adapter on every row is one product pair per module. Several
adapters go as one batched product pair per module over their rows padded to the largest
group (`StackedRows`) when that padding at most doubles the rows, as in decode steps; else
(a long prefill chunk beside a few decodes) each adapter's rows go alone.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.lora.adapter import LoRAAdapter
from kvtier.lora.targets import LoRATarget

MAX_PADDING = 2.0
# Sets of adapters whose stacked weights are kept: a set changes as requests come and go.
NUM_CACHED_STACKS = 4
# (A^T per adapter (n, in, R), B^T per adapter (n, R, out), scaling per adapter (n, 1, 1)).
Stack = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class StackedRows:
    """This step's adapters' rows as an (n adapters, width) grid of batch rows."""

    adapters: tuple[LoRAAdapter, ...]
    width: int
    gather: torch.Tensor  # (n * width,) the batch row of each slot; pads repeat a real row
    valid: torch.Tensor | None  # (V,) the slots that hold real rows; None: all of them
    rows: torch.Tensor  # (V,) their batch rows
    # Module path -> its stacked weights (None: no adapter of the set adapts it), shared by
    # the steps of the same set.
    weights: dict[str, Stack | None] = field(default_factory=dict)


class LoRABatch:
    """This step's adapters and the batch rows (tokens) each one runs on."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # (adapter, its rows: None for every row of the batch, else (R,) indices)
        self.groups: list[tuple[LoRAAdapter, torch.Tensor | None]] = []
        self.stacked: StackedRows | None = None
        self._stacks: OrderedDict[tuple[str, ...], dict[str, Stack | None]] = OrderedDict()

    def begin_step(self, adapters: Sequence[LoRAAdapter | None],
                   query_start: Sequence[int]) -> None:
        """`adapters[i]`: request i's adapter, whose tokens are rows
        [query_start[i], query_start[i + 1])."""
        # By content: one adapter loaded under two names runs once over both names' rows.
        ranges: dict[str, tuple[LoRAAdapter, list[int]]] = {}
        for index, adapter in enumerate(adapters):
            if adapter is not None:
                rows = range(query_start[index], query_start[index + 1])
                ranges.setdefault(adapter.cache_key, (adapter, []))[1].extend(rows)
        self.groups, self.stacked = [], None
        num_rows = sum(len(rows) for _, rows in ranges.values())
        width = max((len(rows) for _, rows in ranges.values()), default=0)
        if len(ranges) > 1 and len(ranges) * width <= MAX_PADDING * num_rows:
            self.stacked = self._stack([ranges[key] for key in sorted(ranges)], width)
            return
        total = query_start[len(adapters)]
        for adapter, rows in ranges.values():
            self.groups.append((adapter, None if len(rows) == total else
                                torch.tensor(rows, dtype=torch.long, device=self.device)))

    def _stack(self, groups: list[tuple[LoRAAdapter, list[int]]], width: int) -> StackedRows:
        gather, valid, rows = [], [], []
        for index, (_, group_rows) in enumerate(groups):
            gather += group_rows + [group_rows[0]] * (width - len(group_rows))
            valid += range(index * width, index * width + len(group_rows))
            rows += group_rows
        key = tuple(adapter.cache_key for adapter, _ in groups)
        weights = self._stacks.pop(key, None)
        if weights is None:
            weights = {}
            if len(self._stacks) >= NUM_CACHED_STACKS:
                self._stacks.popitem(last=False)
        self._stacks[key] = weights

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        return StackedRows(tuple(adapter for adapter, _ in groups), width, tensor(gather),
                           None if len(valid) == len(gather) else tensor(valid), tensor(rows),
                           weights)

    def end_step(self) -> None:
        self.groups, self.stacked = [], None


def _stack_module(adapters: tuple[LoRAAdapter, ...], path: str) -> Stack | None:
    """The adapters' weights of one module, zero-padded to their largest rank (an adapter
    that does not adapt it gets zeros)."""
    present = [adapter.weights.get(path) for adapter in adapters]
    known = [w for w in present if w is not None]
    if not known:
        return None
    rank = max(w.lora_a.shape[0] for w in known)
    like = known[0].lora_a
    a_t = like.new_zeros(len(adapters), known[0].lora_a.shape[1], rank)
    b_t = like.new_zeros(len(adapters), rank, known[0].lora_b.shape[0])
    scales = like.new_zeros(len(adapters), 1, 1)
    for index, weights in enumerate(present):
        if weights is not None:
            r = weights.lora_a.shape[0]
            a_t[index, :, :r] = weights.lora_a.t()
            b_t[index, :r, :] = weights.lora_b.t()
            scales[index] = weights.scaling
    return a_t, b_t, scales


class LoRALinear(nn.Module):
    """`base(x)` plus, for each adapter of the step that adapts this module, its product on
    that adapter's rows."""

    def __init__(self, base: nn.Module, path: str, batch: LoRABatch) -> None:
        super().__init__()
        self.base = base
        self.path = path
        self.batch = batch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)  # (T, out_features)
        if self.batch.stacked is not None:
            return self._add_stacked(x, out, self.batch.stacked)
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

    def _add_stacked(self, x: torch.Tensor, out: torch.Tensor,
                     stacked: StackedRows) -> torch.Tensor:
        if self.path not in stacked.weights:
            stacked.weights[self.path] = _stack_module(stacked.adapters, self.path)
        weights = stacked.weights[self.path]
        if weights is None:
            return out
        a_t, b_t, scales = weights
        inputs = x.index_select(0, stacked.gather).view(len(stacked.adapters), stacked.width,
                                                        -1)  # (n, width, in)
        hidden = torch.bmm(inputs, a_t).mul_(scales)  # (n, width, R)
        delta = torch.bmm(hidden, b_t).view(-1, out.shape[1])  # (n * width, out)
        if stacked.valid is not None:
            delta = delta.index_select(0, stacked.valid)
        return out.index_add_(0, stacked.rows, delta)


def attach_lora(model: nn.Module, targets: dict[str, LoRATarget],
                device: torch.device) -> LoRABatch:
    """Wrap every module the targets name; returns the batch state they share."""
    batch = LoRABatch(device)
    for path in sorted({target.module for target in targets.values()}):
        parent_path, _, attribute = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        setattr(parent, attribute, LoRALinear(getattr(parent, attribute), path, batch))
    return batch
