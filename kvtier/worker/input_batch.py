"""Turns one step's scheduled requests into model inputs: token ids, positions and the
attention metadata (block tables and slot mapping per KV cache group).

Everything is written into buffers allocated once, so a step allocates no new host arrays for
the batch (only the small device copies on an accelerator).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvtier.models.attention_metadata import AttentionMetadata
from kvtier.worker.request_state import RequestState


@dataclass
class BatchInputs:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    metadata: AttentionMetadata
    # Index into the flattened batch of each sampling request's last token.
    logits_indices: torch.Tensor  # (S,)
    # The requests that sample this step (their whole known sequence is now computed).
    sampling: list[RequestState]
    # Speculative decoding: (row of `sampling`, its draft tokens) of each request that
    # computes drafts, and the index of each draft's preceding position, where the model's
    # token is compared with the draft (all requests' in that order).
    drafts: list[tuple[int, list[int]]] = field(default_factory=list)
    draft_logits_indices: torch.Tensor | None = None


class InputBatchBuilder:
    def __init__(self, *, num_groups: int, block_size: int, max_num_seqs: int,
                 max_num_tokens: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        # (group, seq, block index) -> block id; 0 (the null block) pads.
        self.block_tables = np.zeros((num_groups, max_num_seqs, max_blocks_per_seq), np.int64)
        self.input_ids = np.zeros(max_num_tokens, np.int64)
        self.positions = np.zeros(max_num_tokens, np.int64)
        self.query_start = np.zeros(max_num_seqs + 1, np.int64)
        self.seq_index = np.zeros(max_num_tokens, np.int64)

    def build(self, scheduled: list[tuple[RequestState, int]], hooks: Any,
              drafts: Mapping[str, list[int]] | None = None) -> BatchInputs:
        """scheduled: (request, number of new tokens) in batch order; `drafts`: the draft
        tokens that end some requests' new tokens (scheduled_spec_decode_tokens)."""
        num_seqs = len(scheduled)
        num_new = np.fromiter((n for _, n in scheduled), np.int64, num_seqs)
        num_computed = [state.num_computed_tokens for state, _ in scheduled]
        total = int(num_new.sum())
        self._ensure_token_capacity(total)
        np.cumsum(num_new, out=self.query_start[1:num_seqs + 1])
        starts = self.query_start[:num_seqs]
        flat: list[int] = []
        for state, n in scheduled:
            piece = state.token_ids[state.num_computed_tokens:state.num_computed_tokens + n]
            flat.extend(piece)
            if len(piece) < n:
                flat.extend(drafts[state.req_id])
        self.input_ids[:total] = flat
        seq_index = self.seq_index[:total]
        seq_index[:] = np.repeat(np.arange(num_seqs), num_new)
        positions = self.positions[:total]
        # Token t of sequence s sits at num_computed[s] + (t - start[s]).
        np.subtract(np.arange(total), starts[seq_index], out=positions)
        positions += np.asarray(num_computed, np.int64)[seq_index]
        block_tables, slot_mappings = self._fill_block_tables(scheduled, seq_index, positions)
        seq_lens = [c + int(n) for c, n in zip(num_computed, num_new)]
        # A request samples once this step computes its last known token.
        sampling_rows = [i for i, (state, n) in enumerate(scheduled)
                         if state.num_computed_tokens + n >= len(state.token_ids)]
        sampling = [scheduled[i][0] for i in sampling_rows]
        ends = self.query_start[1:num_seqs + 1][sampling_rows] - 1
        query_start = self.query_start[:num_seqs + 1]
        metadata = AttentionMetadata(
            num_seqs=num_seqs, query_start_loc=self._to_device(query_start),
            query_start_loc_list=query_start.tolist(), seq_lens=seq_lens,
            num_computed=num_computed, block_tables=block_tables, slot_mapping=slot_mappings,
            is_decode_only=bool((num_new == 1).all()), block_size=self.block_size,
            layer_hooks=hooks)
        inputs = BatchInputs(self._to_device(self.input_ids[:total]),
                             self._to_device(positions), metadata,
                             torch.from_numpy(ends).to(self.device), sampling)
        if drafts:
            inputs.drafts = [(row, drafts[state.req_id]) for row, state in enumerate(sampling)
                             if state.req_id in drafts]
            indices = np.concatenate([np.arange(ends[row] - len(d), ends[row])
                                      for row, d in inputs.drafts])
            inputs.draft_logits_indices = torch.from_numpy(indices).to(self.device)
        return inputs

    def _fill_block_tables(self, scheduled: list[tuple[RequestState, int]],
                           seq_index: np.ndarray,
                           positions: np.ndarray) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        num_seqs = len(scheduled)
        block_tables, slot_mappings = [], []
        for group in range(self.block_tables.shape[0]):
            width = max(len(state.block_ids[group]) for state, _ in scheduled)
            self._ensure_block_capacity(width)
            table = self.block_tables[group]
            table[:num_seqs, :width] = 0
            for row, (state, _) in enumerate(scheduled):
                ids = state.block_ids[group]
                table[row, :len(ids)] = ids
            # Slot of a token = its block's id * block_size + its offset in the block.
            block_ids = table[seq_index, positions // self.block_size]
            slots = block_ids * self.block_size + positions % self.block_size
            block_tables.append(self._to_device(table[:num_seqs, :width]))
            slot_mappings.append(self._to_device(slots))
        return block_tables, slot_mappings

    def _ensure_token_capacity(self, total: int) -> None:
        # Only a step larger than the configured budget (chunked prefill off) gets here.
        if total > len(self.input_ids):
            self.input_ids = np.zeros(total, np.int64)
            self.positions = np.zeros(total, np.int64)
            self.seq_index = np.zeros(total, np.int64)

    def _ensure_block_capacity(self, width: int) -> None:
        if width > self.block_tables.shape[2]:
            grown = np.zeros(self.block_tables.shape[:2] + (width,), np.int64)
            grown[:, :, :self.block_tables.shape[2]] = self.block_tables
            self.block_tables = grown

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        if self.device.type == "cpu":
            # The model reads it before the next step rewrites the buffer, so sharing is safe.
            return tensor
        return tensor.to(self.device, non_blocking=True)
