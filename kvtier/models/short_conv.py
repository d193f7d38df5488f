"""Gated short convolution (LFM2's `conv` layers) over a paged recurrent state.

A layer computes `out_proj(C * conv(B * x))` where B, C, x split `in_proj(hidden)` and `conv` is
a causal depthwise convolution with `K` taps. Its only memory of the past is the last `K - 1`
inputs of the convolution, the state, which lives in the layer's state cache:

    (1, num_blocks, K - 1, hidden)   one page per block, rows in token order (oldest first)

Block j of a request holds the state after the block's last token (the short-conv group is a
MambaSpec group), so a step writes the state at every block boundary it crosses, and the state
after its last token into the block that token is in; the next step reads it back from there.
Block boundaries are where a prefix hit may resume, so every full block keeps a usable state.
The leading 1 keeps the page index on dim 1, as in the attention caches, so the offloading
copier moves both kinds of page alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvtier.models.attention_metadata import AttentionMetadata, cdiv


@dataclass(frozen=True)
class ConvStatePlan:
    """Where one step's conv inputs and states go; shared by every conv layer of the step.

    Each sequence gets a segment of the extended input `ext`: its K - 1 state rows, then its
    new inputs, so the window of a token at segment row r is rows r .. r + K - 1.
    """

    # (S,) block holding each sequence's state before this step, and whether it has one
    # (a sequence starting at token 0 has none: zeros, as HF pads).
    read_blocks: torch.Tensor
    has_state: torch.Tensor
    # (S * (K - 1),) rows of ext for the states; (T,) rows of ext for the new inputs.
    state_rows: torch.Tensor
    input_rows: torch.Tensor
    # (K, T) row of ext under tap k of each new token.
    tap_rows: torch.Tensor
    # (W,) blocks that receive a state this step and (W * (K - 1),) the ext rows of each.
    write_blocks: torch.Tensor
    write_rows: torch.Tensor
    # (state rows, ext rows): a sequence whose prefix hit is a block another sequence of this
    # step is still computing takes that state from the other's rows, not from the page (which
    # holds it only once the layer is done). In batch order.
    same_step_states: tuple[tuple[torch.Tensor, torch.Tensor], ...]


def _state_writes(block_size: int, num_computed: int, seq_len: int,
                  table: list[int]) -> list[tuple[int, int]]:
    """(block id, tokens computed when its state is taken) for one sequence's step: every
    block boundary crossed, and the step's end in the block of its last token."""
    first = num_computed // block_size + 1
    ends = [j * block_size for j in range(first, seq_len // block_size + 1)]
    if not ends or ends[-1] != seq_len:
        ends.append(seq_len)
    return [(table[cdiv(end, block_size) - 1], end) for end in ends]


def build_conv_plan(meta: AttentionMetadata, group_id: int, num_taps: int,
                    device: torch.device) -> ConvStatePlan:
    width = num_taps - 1
    tables = meta.block_tables[group_id].tolist()
    starts = meta.query_start_loc_list
    read_blocks, state_rows, input_rows, write_blocks, write_rows = [], [], [], [], []
    seq_of_token = []
    # block -> the ext rows of the state written into it this step
    written: dict[int, list[int]] = {}
    for seq in range(meta.num_seqs):
        computed, seq_len = meta.num_computed[seq], meta.seq_lens[seq]
        segment = starts[seq] + seq * width  # first ext row of the sequence
        read_blocks.append(tables[seq][cdiv(computed, meta.block_size) - 1] if computed else 0)
        state_rows.append(list(range(segment, segment + width)))
        input_rows.extend(range(segment + width, segment + width + seq_len - computed))
        seq_of_token.extend([seq] * (seq_len - computed))
        for block, end in _state_writes(meta.block_size, computed, seq_len, tables[seq]):
            # The state after `end` tokens: inputs at positions end - K + 1 .. end - 1.
            first = segment + end - computed
            written[block] = list(range(first, first + width))
            write_blocks.append(block)
            write_rows.extend(written[block])
    # From a block boundary a sequence writes only past its read block, so a read block written
    # this step was written by another sequence (the block is a prefix hit on it).
    same_step = [(state_rows[seq], written[block]) for seq, block in enumerate(read_blocks)
                 if block in written and meta.num_computed[seq] % meta.block_size == 0]
    tokens = torch.arange(len(seq_of_token)) + torch.tensor(seq_of_token, dtype=torch.long) * width
    taps = tokens[None, :] + torch.arange(num_taps)[:, None]  # (K, T)

    def to_device(values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)
    return ConvStatePlan(
        to_device(read_blocks), to_device([c > 0 for c in meta.num_computed], torch.bool),
        to_device([row for rows in state_rows for row in rows]), to_device(input_rows),
        taps.to(device), to_device(write_blocks), to_device(write_rows),
        tuple((to_device(dst), to_device(src)) for dst, src in same_step))


class ShortConv(nn.Module):
    """HF's Lfm2ShortConv over paged states; `conv_weight` is its (hidden, 1, K) taps."""

    def __init__(self, hidden_size: int, num_taps: int, bias: bool, layer_name: str,
                 group_id: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.num_taps = num_taps
        self.in_proj = nn.Linear(hidden_size, 3 * hidden_size, bias=bias, dtype=dtype)
        self.out_proj = nn.Linear(hidden_size, hidden_size, bias=bias, dtype=dtype)
        self.conv_weight = nn.Parameter(torch.empty(hidden_size, 1, num_taps, dtype=dtype))
        self.conv_bias = nn.Parameter(torch.empty(hidden_size, dtype=dtype)) if bias else None
        self.layer_name = layer_name
        self.group_id = group_id

    def forward(self, hidden: torch.Tensor, state_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        """hidden (T, hidden); state_cache (1, num_blocks, K - 1, hidden) -> (T, hidden)."""
        plan = self._plan(metadata, state_cache)
        b, c, x = self.in_proj(hidden).chunk(3, dim=-1)  # 3 x (T, hidden)
        hooks = metadata.layer_hooks
        if hooks is not None:
            hooks.wait_for_layer_load(self.layer_name)
        pages = state_cache[0]  # (num_blocks, K - 1, hidden)
        states = pages.index_select(0, plan.read_blocks)  # (S, K - 1, hidden)
        states.mul_(plan.has_state[:, None, None])
        ext = hidden.new_empty(plan.state_rows.shape[0] + hidden.shape[0], self.hidden_size)
        ext.index_copy_(0, plan.state_rows, states.view(-1, self.hidden_size))
        ext.index_copy_(0, plan.input_rows, b * x)
        for dst, src in plan.same_step_states:
            ext.index_copy_(0, dst, ext.index_select(0, src))
        # (K, T, hidden) windows times the (K, 1, hidden) taps, summed over the taps.
        windows = ext.index_select(0, plan.tap_rows.flatten()).view(self.num_taps, -1,
                                                                    self.hidden_size)
        taps = self.conv_weight.view(self.hidden_size, self.num_taps).t()[:, None, :]
        conv = (windows * taps).sum(dim=0)
        if self.conv_bias is not None:
            conv = conv + self.conv_bias
        written = ext.index_select(0, plan.write_rows)  # (W * (K - 1), hidden)
        pages.index_copy_(0, plan.write_blocks, written.view(-1, self.num_taps - 1,
                                                             self.hidden_size))
        if hooks is not None:
            hooks.save_kv_layer(self.layer_name, state_cache, metadata)
        return self.out_proj(c * conv)

    def _plan(self, metadata: AttentionMetadata, state_cache: torch.Tensor) -> ConvStatePlan:
        key = (self.group_id, None, state_cache.shape[1])
        plan = metadata.plans.get(key)
        if plan is None:
            plan = metadata.plans[key] = build_conv_plan(metadata, self.group_id,
                                                         self.num_taps, state_cache.device)
        return plan
