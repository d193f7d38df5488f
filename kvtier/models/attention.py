"""Paged attention over the block-table KV cache: the fast path used by the decoder and a plain
reference the tests hold it to.

Fast path: every sequence with one new token (decode) is gathered into one padded batch and run
through a single scaled_dot_product_attention call under a mask; each sequence with several new
tokens (prefill, or a prefill chunk over a cached prefix) gathers its own blocks and runs one call
with the causal offset. Sliding window: a query at position p attends keys in (p - window, p];
blocks wholly before the window are not read at all.

The gather plans depend only on the step's metadata, the group and its window, so they are built
once per step and group and shared by all layers of the group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvtier.models.attention_metadata import AttentionMetadata, build_attention_metadata, cdiv

__all__ = ["AttentionMetadata", "build_attention_metadata", "write_kv", "paged_attention",
           "reference_paged_attention"]


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K and V (num_tokens, num_kv_heads, head_dim) at their slots."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    # (num_blocks, block_size, H, D) -> (num_blocks * block_size, H, D): slot = row.
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


@dataclass(frozen=True)
class _PrefillPlan:
    query_start: int
    query_end: int
    # Blocks holding keys [first_block * block_size, seq_len).
    blocks: torch.Tensor
    # Index of the first attended key within the gathered tokens.
    first_token: int
    num_keys: int
    # (query_len, num_keys) True = attend; None = plain causal (query_len == num_keys).
    mask: torch.Tensor | None


@dataclass(frozen=True)
class _DecodePlan:
    # (num_decodes,) rows of the decode queries in the flattened batch.
    rows: torch.Tensor
    # (num_decodes, max_blocks) blocks to gather per sequence.
    blocks: torch.Tensor
    # (num_decodes, 1, 1, max_blocks * block_size) True = attend.
    mask: torch.Tensor


@dataclass(frozen=True)
class _GroupPlan:
    decode: _DecodePlan | None
    prefills: tuple[_PrefillPlan, ...]


def _first_key(num_computed: int, window: int | None) -> int:
    """Earliest key position any of this step's queries attends."""
    return 0 if window is None else max(0, num_computed - window + 1)


def _prefill_plan(meta: AttentionMetadata, seq: int, group_id: int, window: int | None,
                  block_size: int) -> _PrefillPlan:
    computed, seq_len = meta.num_computed[seq], meta.seq_lens[seq]
    first_key = _first_key(computed, window)
    first_block = first_key // block_size
    blocks = meta.block_tables[group_id][seq, first_block:cdiv(seq_len, block_size)]
    num_queries, num_keys = seq_len - computed, seq_len - first_key
    mask = None
    if num_queries != num_keys or (window is not None and window < num_keys):
        device = blocks.device
        query_pos = torch.arange(computed, seq_len, device=device)[:, None]
        key_pos = torch.arange(first_key, seq_len, device=device)[None, :]
        mask = key_pos <= query_pos
        if window is not None:
            mask &= key_pos > query_pos - window
    return _PrefillPlan(meta.query_start_loc_list[seq], meta.query_start_loc_list[seq + 1],
                        blocks, first_key - first_block * block_size, num_keys, mask)


def _decode_plan(meta: AttentionMetadata, seqs: list[int], group_id: int, window: int | None,
                 block_size: int) -> _DecodePlan:
    table = meta.block_tables[group_id]
    device = table.device
    seq_lens = [meta.seq_lens[s] for s in seqs]
    first_keys = [_first_key(n - 1, window) for n in seq_lens]
    first_blocks = [k // block_size for k in first_keys]
    max_blocks = max(cdiv(n, block_size) - b for n, b in zip(seq_lens, first_blocks))
    # (num_decodes, max_blocks) logical block index per gathered block.
    logical = (torch.tensor(first_blocks, device=device)[:, None]
               + torch.arange(max_blocks, device=device)[None, :])
    rows = torch.tensor(seqs, dtype=torch.long, device=device)
    # Clamped columns read some real block; the mask below hides them by their true position.
    blocks = torch.gather(table[rows], 1, logical.clamp(max=table.shape[1] - 1))
    # (num_decodes, max_blocks * block_size) absolute key positions.
    key_pos = (logical[:, :, None] * block_size
               + torch.arange(block_size, device=device)).reshape(len(seqs), -1)
    mask = ((key_pos < torch.tensor(seq_lens, device=device)[:, None])
            & (key_pos >= torch.tensor(first_keys, device=device)[:, None]))
    query_rows = torch.tensor([meta.query_start_loc_list[s] for s in seqs], device=device)
    # (num_decodes, max_keys) -> (num_decodes, 1 head, 1 query, max_keys)
    return _DecodePlan(query_rows, blocks, mask[:, None, None, :])


def _group_plan(meta: AttentionMetadata, group_id: int, window: int | None,
                block_size: int) -> _GroupPlan:
    key = (group_id, window)
    plan = meta.plans.get(key)
    if plan is None:
        lens = meta.query_lens
        decodes = [s for s in range(meta.num_seqs) if lens[s] == 1]
        plan = _GroupPlan(
            decode=_decode_plan(meta, decodes, group_id, window, block_size) if decodes else None,
            prefills=tuple(_prefill_plan(meta, s, group_id, window, block_size)
                           for s in range(meta.num_seqs) if lens[s] > 1))
        meta.plans[key] = plan
    return plan


def _gather_blocks(kv_cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """(2, num_blocks, block_size, Hkv, D) cache, (n,) block ids -> (2, n * block_size, Hkv, D).

    index_select on a flat view: advanced indexing over dim 1 is ~100x slower on CPU."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    # (2, num_blocks, block_size, Hkv, D) -> (2, num_blocks, block_size * Hkv * D)
    flat = kv_cache.view(2, kv_cache.shape[1], -1)
    return flat.index_select(1, blocks).view(2, -1, num_kv_heads, head_dim)


def _attend_decodes(query: torch.Tensor, kv_cache: torch.Tensor, plan: _DecodePlan,
                    scale: float) -> torch.Tensor:
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    num_decodes = plan.blocks.shape[0]
    # (2, B * max_keys, Hkv, D) -> (2, B, max_keys, Hkv, D)
    kv = _gather_blocks(kv_cache, plan.blocks.flatten()).view(2, num_decodes, -1, num_kv_heads,
                                                               head_dim)
    keys, values = kv[0].transpose(1, 2), kv[1].transpose(1, 2)  # (B, Hkv, max_keys, D)
    # The query heads sharing a kv head ride along the query-length axis, so K/V are not
    # repeated: (B, Hq, D) -> (B, Hkv, Hq / Hkv, D).
    q = query[plan.rows].reshape(num_decodes, num_kv_heads, -1, head_dim)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=plan.mask, scale=scale)
    return out.reshape(num_decodes, -1, head_dim)  # (B, Hq, D)


def _attend_prefill(query: torch.Tensor, kv_cache: torch.Tensor, plan: _PrefillPlan,
                    scale: float) -> torch.Tensor:
    # (2, n_tokens, Hkv, D) -> the attended keys only.
    kv = _gather_blocks(kv_cache, plan.blocks)[:, plan.first_token:plan.first_token + plan.num_keys]
    keys, values = kv[0].transpose(0, 1), kv[1].transpose(0, 1)  # (Hkv, n_keys, D)
    q = query[plan.query_start:plan.query_end].transpose(0, 1)  # (Hq, n_queries, D)
    # A batch dim of 1: 4-D inputs take torch's flash kernel on CPU, 3-D ones the slow math
    # path (measured 4.6x on a 2,000-token SmolLM2 prefill). (H, n, D) -> (1, H, n, D)
    out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=plan.mask,
                                         is_causal=plan.mask is None, scale=scale,
                                         enable_gqa=True)[0]
    return out.transpose(0, 1)  # (n_queries, Hq, D)


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                    group_id: int, scale: float, sliding_window: int | None) -> torch.Tensor:
    """Attention of the step's queries (num_tokens, num_heads, head_dim) over the paged cache,
    which must already hold this step's K/V. Returns (num_tokens, num_heads, head_dim)."""
    plan = _group_plan(metadata, group_id, sliding_window, kv_cache.shape[2])
    if plan.decode is not None and not plan.prefills:
        # Decode-only steps return the batch as is: rows are already in sequence order.
        return _attend_decodes(query, kv_cache, plan.decode, scale)
    out = torch.empty_like(query)
    if plan.decode is not None:
        out[plan.decode.rows] = _attend_decodes(query, kv_cache, plan.decode, scale)
    for prefill in plan.prefills:
        out[prefill.query_start:prefill.query_end] = _attend_prefill(query, kv_cache, prefill,
                                                                     scale)
    return out


def reference_paged_attention(query: torch.Tensor, kv_cache: torch.Tensor,
                              metadata: AttentionMetadata, group_id: int, scale: float,
                              sliding_window: int | None) -> torch.Tensor:
    """The same result as `paged_attention`, one query and one key at a time, in fp32."""
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group_size = query.shape[1] // num_kv_heads
    out = torch.empty_like(query)
    for seq in range(metadata.num_seqs):
        table = metadata.block_tables[group_id][seq].tolist()
        start = metadata.query_start_loc_list[seq]
        for i, pos in enumerate(range(metadata.num_computed[seq], metadata.seq_lens[seq])):
            lowest = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            slots = [(table[p // block_size], p % block_size) for p in range(lowest, pos + 1)]
            # (n_keys, Hkv, D) -> (n_keys, Hq, D): query head h reads kv head h // group_size.
            k = torch.stack([kv_cache[0, b, o] for b, o in slots]).float()
            v = torch.stack([kv_cache[1, b, o] for b, o in slots]).float()
            k = k.repeat_interleave(group_size, dim=1)
            v = v.repeat_interleave(group_size, dim=1)
            q = query[start + i].float()  # (Hq, D)
            weights = torch.softmax(torch.einsum("hd,nhd->hn", q, k) * scale, dim=-1)
            out[start + i] = torch.einsum("hn,nhd->hd", weights, v).to(query.dtype)
    return out
