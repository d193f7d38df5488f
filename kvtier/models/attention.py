"""Paged attention over the block-table KV cache: the fast path used by the decoder and a plain
reference the tests hold it to.

Fast path on the CPU: the C++ kernels (kvtier/models/csrc) read the pages in place. Every sequence
with one new token (decode) goes through paged_decode.cpp; every prefill through paged_prefill.cpp,
all of them in one call per layer, except that in fp32 and fp16 prefills of over
KERNEL_PREFILL_MAX_QUERIES new tokens, every prefill of a cache shape the prefill kernel does not
take (outside its bf16 tiles, which take any block size, it is vectorised for head dim 64 or 128
with 16-token blocks only: on 8- or 32-token blocks a generic loop ran 4-10x slower than torch, a
747-token prompt in 71 vs 9 ms per layer), and every prefill where the kernels are unavailable
(CUDA, no compiler), gather their own blocks and run one scaled_dot_product_attention call with the
causal offset. In fp32 and fp16 torch's flash kernel wins on long square prompts (measured 56 vs 66
ms for 2,048 new tokens), the C++ kernel on short chunks over a long context (2-3x: no gather, no
per-sequence call). In bf16 on a CPU with AVX512-BF16 the kernel's bf16 tiles win at every length
and block size (8, 16 or 32 tokens measured alike): on an AMD EPYC (vdpbf16ps) 2.8x on a
2,048-token prompt (31 vs 87 ms per layer), 3.4x on a 2,048-token chunk over 6,144 cached tokens
(176 vs 597 ms: the flash kernel needs a dense mask for the causal offset); on an Intel Sapphire
Rapids (AMX tiles) 1.1x on the prompt (7.2 vs 8.0 ms), 1.5x on the chunk (48 vs 74 ms). Without the
decode kernel, decodes are gathered into one padded batch and run through two batched matmuls with
a softmax between them.
Sliding window: a query at position p attends keys in (p - window, p]; blocks wholly before the
window are not read at all.
An fp8 cache (--kv-cache-dtype) holds K and V rounded to its format (write_kv). The decode kernel
reads its pages as they are; every other path reads the blocks it needs converted to the query
dtype first (the C++ gather_fp8_pages, or torch): a prefill computes far more per key than it
reads, so the copy costs little (a 128-token chunk over 1,024 cached tokens: 0.7 vs 0.6 ms).

The plans depend only on the step's metadata, the group and its window, so they are built once
per step and group and shared by all layers of the group.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvtier.models import cpu_kernels
from kvtier.models.attention_metadata import AttentionMetadata, build_attention_metadata, cdiv

__all__ = ["AttentionMetadata", "build_attention_metadata", "write_kv", "paged_attention",
           "reference_paged_attention"]


def write_kv(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K and V (num_tokens, num_kv_heads, head_dim) at their slots; an
    fp8 cache takes them rounded to its format, saturated at its largest finite value (vLLM's
    fp8 KV cache with unit scales)."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    for part, new in ((kv_cache[0], key), (kv_cache[1], value)):
        # (num_blocks, block_size, H, D) -> (num_blocks * block_size, H, D): slot = row.
        rows = part.view(-1, num_kv_heads, head_dim)
        if rows.dtype != new.dtype:
            limit = torch.finfo(rows.dtype).max
            new = new.clamp(-limit, limit).to(rows.dtype)
            # index_copy_ has no fp8 kernel on the CPU; the bytes are the same.
            rows, new = rows.view(torch.uint8), new.view(torch.uint8)
        rows.index_copy_(0, slot_mapping, new)


@dataclass(frozen=True)
class _PrefillPlan:
    query_start: int
    query_end: int
    # (2 * n,) rows of the (2 * num_blocks, page) cache view: K pages, then V pages, of the
    # blocks holding keys [first_block * block_size, seq_len).
    kv_rows: torch.Tensor
    # Index of the first attended key within the gathered tokens.
    first_token: int
    num_keys: int
    # (query_len, num_keys) True = attend; None = plain causal (query_len == num_keys).
    mask: torch.Tensor | None


@dataclass(frozen=True)
class _DecodePlan:
    # (num_decodes,) rows of the decode queries in the flattened batch.
    rows: torch.Tensor
    # (2 * num_decodes * max_blocks,) rows of the (2 * num_blocks, page) cache view.
    kv_rows: torch.Tensor
    # (num_decodes, 1, max_blocks * block_size) fp32, 0 = attend, -inf = not; None when every
    # sequence attends all its gathered tokens (equal lengths on a block boundary).
    mask: torch.Tensor | None


@dataclass(frozen=True)
class _KernelDecodePlan:
    """The C++ kernel reads the paged cache in place: only block tables and key ranges."""
    kernel: Callable
    # (num_decodes,) rows of the decode queries in the flattened batch.
    rows: torch.Tensor
    # (num_decodes, max_blocks) int64 block tables; first and last + 1 attended key positions.
    block_table: torch.Tensor
    first_key: torch.Tensor
    seq_lens: torch.Tensor


@dataclass(frozen=True)
class _KernelPrefillPlan:
    """Every short prefill of the step, for one call of the C++ prefill kernel."""
    kernel: Callable
    # (num_prefills, max_blocks) int64 block tables; per prefill its first query row in the
    # flattened batch, its cached tokens (= position of its first query) and its query count.
    # With staged_rows, the tables index the staged copy instead of the cache.
    block_table: torch.Tensor
    query_start: torch.Tensor
    num_computed: torch.Tensor
    query_lens: torch.Tensor
    window: int  # 0 = no sliding window
    # An fp8 cache: the (2 * n,) K and V rows of the cache view (2 * num_blocks, page) of the
    # prefills' blocks, which each layer copies to the query dtype for the kernel (the prefill
    # kernel reads model-dtype pages; a prefill computes far more per key than it reads).
    staged_rows: torch.Tensor | None = None


@dataclass(frozen=True)
class _GroupPlan:
    decode: _DecodePlan | _KernelDecodePlan | None
    kernel_prefill: _KernelPrefillPlan | None
    prefills: tuple[_PrefillPlan, ...]  # through scaled_dot_product_attention


# fp32 / fp16 prefills with more new tokens than this go to torch's flash kernel (see the module
# docstring); bf16 ones where the kernel has its vdpbf16ps tiles never do.
KERNEL_PREFILL_MAX_QUERIES = 1024


def _kernel_prefill_max_queries(kv_cache: torch.Tensor, dtype: torch.dtype) -> float:
    """The longest prefill the C++ prefill kernel takes, reading pages of `dtype` (the query
    dtype: an fp8 cache is staged in it)."""
    _, _, block_size, _, head_dim = kv_cache.shape
    kernels = cpu_kernels.ops()
    if kernels.paged_prefill_has_bf16_tiles(dtype, head_dim, block_size):
        return math.inf
    if not kernels.paged_prefill_supports(head_dim, block_size):
        return 0
    return KERNEL_PREFILL_MAX_QUERIES


def _first_key(num_computed: int, window: int | None) -> int:
    """Earliest key position any of this step's queries attends."""
    return 0 if window is None else max(0, num_computed - window + 1)


def _kv_rows(blocks: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """Block ids -> their K and V rows in the cache viewed as (2 * num_blocks, page)."""
    flat = blocks.flatten()
    return torch.cat((flat, flat + num_blocks))


def _prefill_plan(meta: AttentionMetadata, seq: int, group_id: int, window: int | None,
                  block_size: int, num_blocks: int) -> _PrefillPlan:
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
                        _kv_rows(blocks, num_blocks), first_key - first_block * block_size,
                        num_keys, mask)


def _decode_plan(meta: AttentionMetadata, seqs: list[int], group_id: int, window: int | None,
                 block_size: int, num_blocks: int) -> _DecodePlan:
    table = meta.block_tables[group_id]
    device = table.device
    seq_lens = [meta.seq_lens[s] for s in seqs]
    first_blocks = [_first_key(n - 1, window) // block_size for n in seq_lens]
    # Per sequence, its attended keys [lows, highs) counted within its own gathered tokens.
    lows = [_first_key(n - 1, window) - b * block_size for n, b in zip(seq_lens, first_blocks)]
    highs = [n - b * block_size for n, b in zip(seq_lens, first_blocks)]
    max_blocks = cdiv(max(highs), block_size)
    # (num_decodes, max_blocks) logical block index per gathered block.
    logical = (torch.tensor(first_blocks, device=device)[:, None]
               + torch.arange(max_blocks, device=device)[None, :])
    rows = torch.tensor(seqs, dtype=torch.long, device=device)
    # Clamped columns read some real block; the mask below hides them by their position.
    blocks = torch.gather(table[rows], 1, logical.clamp(max=table.shape[1] - 1))
    # The matmuls run over every gathered token: a batch slice would make them ~1.5x slower.
    num_keys = max_blocks * block_size
    mask = None
    if any(low != 0 for low in lows) or any(high != num_keys for high in highs):
        position = torch.arange(num_keys, device=device)[None, :]
        attend = ((position >= torch.tensor(lows, device=device)[:, None])
                  & (position < torch.tensor(highs, device=device)[:, None]))
        mask = torch.zeros(attend.shape, device=device).masked_fill_(~attend, float("-inf"))
        # (num_decodes, num_keys) -> (num_decodes, 1 query head, num_keys)
        mask = mask[:, None, :]
    query_rows = torch.tensor([meta.query_start_loc_list[s] for s in seqs], device=device)
    return _DecodePlan(query_rows, _kv_rows(blocks, num_blocks), mask)


def _kernel_decode_plan(meta: AttentionMetadata, seqs: list[int], group_id: int,
                        window: int | None, kernel: Callable) -> _KernelDecodePlan:
    table = meta.block_tables[group_id]
    rows = torch.tensor(seqs, dtype=torch.long)
    seq_lens = [meta.seq_lens[s] for s in seqs]
    first_keys = [_first_key(n - 1, window) for n in seq_lens]
    query_rows = torch.tensor([meta.query_start_loc_list[s] for s in seqs])
    return _KernelDecodePlan(kernel, query_rows, table.index_select(0, rows).contiguous(),
                             torch.tensor(first_keys), torch.tensor(seq_lens))


def _kernel_prefill_plan(meta: AttentionMetadata, seqs: list[int], group_id: int,
                         window: int | None, kernel: Callable,
                         kv_cache: torch.Tensor, dtype: torch.dtype) -> _KernelPrefillPlan:
    rows = torch.tensor(seqs, dtype=torch.long)
    table = meta.block_tables[group_id].index_select(0, rows)
    staged_rows = None
    if kv_cache.dtype != dtype:
        # Only the blocks a query attends (none before its window, none past its end: their
        # columns become the null block), once each; the tables renumbered to match.
        block_size = kv_cache.shape[2]
        first = torch.tensor([_first_key(meta.num_computed[s], window) // block_size
                              for s in seqs])[:, None]
        end = torch.tensor([cdiv(meta.seq_lens[s], block_size) for s in seqs])[:, None]
        column = torch.arange(table.shape[1])[None, :]
        table = torch.where((column >= first) & (column < end), table, 0)
        blocks, table = torch.unique(table, return_inverse=True)
        staged_rows = _kv_rows(blocks, kv_cache.shape[1])
    return _KernelPrefillPlan(
        kernel, table.contiguous(),
        torch.tensor([meta.query_start_loc_list[s] for s in seqs]),
        torch.tensor([meta.num_computed[s] for s in seqs]),
        torch.tensor([meta.seq_lens[s] - meta.num_computed[s] for s in seqs]), window or 0,
        staged_rows)


def _cpu_kernel(kv_cache: torch.Tensor, name: str) -> Callable | None:
    """The C++ kernel `name` when it can take this cache (CPU, contiguous), else None."""
    if kv_cache.device.type != "cpu" or not kv_cache.is_contiguous():
        return None
    kernels = cpu_kernels.ops()
    return None if kernels is None else getattr(kernels, name)


def _group_plan(meta: AttentionMetadata, group_id: int, window: int | None,
                kv_cache: torch.Tensor, dtype: torch.dtype) -> _GroupPlan:
    block_size, num_blocks = kv_cache.shape[2], kv_cache.shape[1]
    key = (group_id, window, num_blocks)
    plan = meta.plans.get(key)
    if plan is None:
        lens = meta.query_lens
        decodes = [s for s in range(meta.num_seqs) if lens[s] == 1]
        prefills = [s for s in range(meta.num_seqs) if lens[s] > 1]
        kernel = _cpu_kernel(kv_cache, "paged_decode_attention") if decodes else None
        if not decodes:
            decode = None
        elif kernel is not None:
            decode = _kernel_decode_plan(meta, decodes, group_id, window, kernel)
        else:
            decode = _decode_plan(meta, decodes, group_id, window, block_size, num_blocks)
        kernel = _cpu_kernel(kv_cache, "paged_prefill_attention") if prefills else None
        limit = _kernel_prefill_max_queries(kv_cache, dtype) if kernel else 0
        short = [s for s in prefills if lens[s] <= limit]
        plan = _GroupPlan(
            decode=decode,
            kernel_prefill=(_kernel_prefill_plan(meta, short, group_id, window, kernel,
                                                 kv_cache, dtype) if short else None),
            prefills=tuple(_prefill_plan(meta, s, group_id, window, block_size, num_blocks)
                           for s in prefills if s not in short))
        meta.plans[key] = plan
    return plan


def _gather(kv_cache: torch.Tensor, kv_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(2, num_blocks, block_size, Hkv, D) cache -> (2, n * block_size, Hkv, D) of the planned
    blocks, in `dtype` (an fp8 cache's pages converted). One index_select over whole pages of a
    (2 * num_blocks, page) view: measured 3x faster than selecting along dim 1, and advanced
    indexing is slower still."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    # (2, num_blocks, block_size, Hkv, D) -> (2 * num_blocks, block_size * Hkv * D)
    pages = kv_cache.view(2 * kv_cache.shape[1], -1)
    if kv_cache.dtype == dtype:
        gathered = pages.index_select(0, kv_rows)
    elif (convert := _cpu_kernel(kv_cache, "gather_fp8_pages")) is not None:
        gathered = convert(pages, kv_rows, dtype)  # torch's fp8 conversion is scalar
    else:
        gathered = pages.index_select(0, kv_rows).to(dtype)
    return gathered.view(2, -1, num_kv_heads, head_dim)


def _attend_decodes(query: torch.Tensor, kv_cache: torch.Tensor,
                    plan: _DecodePlan | _KernelDecodePlan, scale: float) -> torch.Tensor:
    if isinstance(plan, _KernelDecodePlan):
        q = query if plan.rows.shape[0] == query.shape[0] else query[plan.rows]
        return plan.kernel(q.contiguous(), kv_cache, plan.block_table, plan.first_key,
                           plan.seq_lens, scale)
    return _attend_decodes_torch(query, kv_cache, plan, scale)


def _attend_decodes_torch(query: torch.Tensor, kv_cache: torch.Tensor, plan: _DecodePlan,
                          scale: float) -> torch.Tensor:
    """One query per sequence: scores and values as two batched matmuls over the gathered
    (num_keys, Hkv * D) tokens as they lie. Each matmul pairs every query head with every kv
    head (Hkv times the useful products), which on CPU still beats SDPA's flash kernel and a
    copy into a per-head layout; zeros or a diagonal keep each query head to its own kv head,
    which is why every gathered value must be finite (0 * inf is nan)."""
    num_decodes = plan.rows.shape[0]
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    # (2, B * max_keys, Hkv, D) -> (2, B, max_keys, Hkv * D)
    keys, values = _gather(kv_cache, plan.kv_rows, query.dtype).view(
        2, num_decodes, -1, num_kv_heads * head_dim)
    q = query if num_decodes == query.shape[0] else query[plan.rows]  # (B, Hq, D)
    # Block-diagonal queries (B, Hkv * D, Hq): kv head h's rows hold only its own query heads.
    block_q = q.new_zeros(num_decodes, num_kv_heads, head_dim, num_kv_heads, group)
    block_q.diagonal(dim1=1, dim2=3).copy_(
        q.view(num_decodes, num_kv_heads, group, head_dim).permute(0, 3, 2, 1))
    scores = torch.bmm(keys, block_q.view(num_decodes, num_kv_heads * head_dim, num_heads))
    # (B, keys, Hq) -> (B, Hq, keys) in fp32: the softmax runs in fp32 whatever the model dtype.
    scores = scores.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
    scores.mul_(scale)
    if plan.mask is not None:
        scores += plan.mask
    weights = torch.softmax(scores, dim=-1).to(query.dtype)
    # (B, Hq, Hkv * D) -> (B, Hkv_q, G, Hkv_v, D) -> diagonal (B, G, D, Hkv).
    out = torch.bmm(weights, values).view(num_decodes, num_kv_heads, group, num_kv_heads,
                                          head_dim)
    out = out.diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2)  # (B, Hkv, G, D)
    return out.reshape(num_decodes, num_heads, head_dim)


def _attend_prefill(query: torch.Tensor, kv_cache: torch.Tensor, plan: _PrefillPlan,
                    scale: float) -> torch.Tensor:
    # (2, n_tokens, Hkv, D) -> the attended keys only.
    kv = _gather(kv_cache, plan.kv_rows, query.dtype)[
        :, plan.first_token:plan.first_token + plan.num_keys]
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
    plan = _group_plan(metadata, group_id, sliding_window, kv_cache, query.dtype)
    if plan.decode is not None and not plan.prefills and plan.kernel_prefill is None:
        # Decode-only steps return the batch as is: rows are already in sequence order.
        return _attend_decodes(query, kv_cache, plan.decode, scale)
    query = query.contiguous()
    out = torch.empty_like(query)
    if plan.decode is not None:
        out[plan.decode.rows] = _attend_decodes(query, kv_cache, plan.decode, scale)
    if (kp := plan.kernel_prefill) is not None:  # fills its sequences' rows of `out`
        pages = kv_cache
        if kp.staged_rows is not None:
            pages = _gather(kv_cache, kp.staged_rows, query.dtype).view(
                2, -1, *kv_cache.shape[2:])
        kp.kernel(query, pages, kp.block_table, kp.query_start, kp.num_computed,
                  kp.query_lens, kp.window, scale, out)
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
