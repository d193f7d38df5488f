"""Per-step attention metadata: where each sequence's queries sit in the flattened batch and
which paged-cache blocks hold its KV, one block table per KV cache group.

Paged KV cache layout, per layer: one tensor of shape (2, num_blocks, block_size, num_kv_heads,
head_dim), K at [0] and V at [1]; block ids index dim 1. Block 0 is the null block: it pads block
tables and is never read for real data, but it is read under a zero mask, so the runner must
allocate the cache with finite values (torch.zeros).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class AttentionMetadata:
    num_seqs: int
    # (num_seqs + 1,) cumulative query lengths in the flattened batch.
    query_start_loc: torch.Tensor
    # The same as a python list, for slicing without a device sync.
    query_start_loc_list: list[int]
    # Per sequence: context length after this step (num_computed + new tokens).
    seq_lens: list[int]
    # Per sequence: tokens whose KV was already in the cache before this step.
    num_computed: list[int]
    # Per KV cache group: (num_seqs, max_blocks) block ids, padded with the null block 0.
    block_tables: list[torch.Tensor]
    # Per KV cache group: (num_tokens,) block_id * block_size + offset of each new token.
    slot_mapping: list[torch.Tensor]
    # Every sequence has exactly one new token.
    is_decode_only: bool
    # Token positions per block (every KV cache group uses the same).
    block_size: int
    # A KVConnectorWorker whose per-layer hooks run around attention, or None (no cost).
    layer_hooks: Any = None
    # Gather plans shared by every layer of a group within this step (built on first use),
    # keyed by (group id, sliding window, num_blocks of the cache); short-conv groups too.
    plans: dict[tuple[int, int | None, int], Any] = field(default_factory=dict, repr=False)

    @property
    def query_lens(self) -> list[int]:
        starts = self.query_start_loc_list
        return [starts[i + 1] - starts[i] for i in range(self.num_seqs)]

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_list[-1]


def _slot_mapping(block_ids: Sequence[Sequence[int]], num_computed: Sequence[int],
                  query_lens: Sequence[int], block_size: int) -> list[int]:
    slots = []
    for blocks, start, length in zip(block_ids, num_computed, query_lens):
        for pos in range(start, start + length):
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    return slots


def _block_table(block_ids: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    width = max((len(b) for b in block_ids), default=0)
    rows = [list(b) + [0] * (width - len(b)) for b in block_ids]
    return torch.tensor(rows, dtype=torch.long, device=device).reshape(len(rows), width)


def build_attention_metadata(num_computed: Sequence[int], query_lens: Sequence[int],
                             block_ids: Sequence[Sequence[Sequence[int]]], block_size: int,
                             device: torch.device | str = "cpu",
                             layer_hooks: Any = None) -> AttentionMetadata:
    """Metadata for one step from plain lists.

    `block_ids[g][i]` is the block table of sequence i in KV cache group g; it must cover the
    sequence's context after this step (null block 0 where a sliding window dropped a block).
    """
    if len(num_computed) != len(query_lens):
        raise ValueError(f"num_computed ({len(num_computed)}) and query_lens ({len(query_lens)}) "
                         "must have one entry per sequence")
    starts = [0]
    for length in query_lens:
        starts.append(starts[-1] + length)
    device = torch.device(device)
    return AttentionMetadata(
        num_seqs=len(query_lens),
        query_start_loc=torch.tensor(starts, dtype=torch.long, device=device),
        query_start_loc_list=starts,
        seq_lens=[c + q for c, q in zip(num_computed, query_lens)],
        num_computed=list(num_computed),
        block_tables=[_block_table(group, device) for group in block_ids],
        slot_mapping=[torch.tensor(_slot_mapping(group, num_computed, query_lens, block_size),
                                   dtype=torch.long, device=device) for group in block_ids],
        is_decode_only=all(q == 1 for q in query_lens), block_size=block_size,
        layer_hooks=layer_hooks)
