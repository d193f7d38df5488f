"""Device <-> host copies of chunks between the paged KV cache and the host area.

Paged cache, per layer: (2, num_blocks, block_size, num_kv_heads, head_dim), K at [0], V at [1].
Host slot (standard layout, kvtier.offload.layout): (blocks_per_chunk, num_layers, page) with
page = K then V of one block, each (block_size, num_kv_heads, head_dim) contiguous.

A step's transfers of one group are copied together, one gather and one scatter per layer
whatever the number of chunks: per-chunk copies of 10 KiB pages would be all call overhead.
Two paths do the same copies: the torch path serves any device (on CUDA on a side stream that
first waits for the compute stream; the copy thread then waits for that stream), and on CPU a
numpy path does them as byte-row gathers, which run at memcpy speed where torch's CPU index
kernels copy element by element (~10x slower). Tests check the two agree byte for byte.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import numpy as np
import torch

from kvtier.connector.offloading.metadata import ChunkTransfer
from kvtier.offload.layout import ChunkLayout


class ChunkCopier:
    def __init__(self, host_area: np.ndarray, slot_bytes: int,
                 group_caches: Sequence[Sequence[torch.Tensor]],
                 layouts: Sequence[ChunkLayout], use_numpy: bool | None = None) -> None:
        """`use_numpy`: None picks the numpy path for CPU caches (False forces torch's)."""
        self.group_caches = group_caches
        self.layouts = layouts
        host_bytes = torch.from_numpy(host_area)
        self.slots = [_slots_view(host_bytes, slot_bytes, layout, caches[0])
                      for layout, caches in zip(layouts, group_caches)]
        device = group_caches[0][0].device
        self.use_numpy = device.type == "cpu" if use_numpy is None else use_numpy
        if self.use_numpy:
            self.slot_rows = [_slot_rows(host_area, slot_bytes, layout) for layout in layouts]
            self.cache_rows = [[_cache_rows(cache) for cache in caches]
                               for caches in group_caches]
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def record_compute(self) -> torch.cuda.Event | None:
        """A marker after this step's forward, for the copy stream to wait on (CUDA only)."""
        if self.stream is None:
            return None
        return torch.cuda.current_stream(self.stream.device).record_event()

    @torch.inference_mode()
    def device_to_host(self, transfers: Sequence[ChunkTransfer],
                       after: torch.cuda.Event | None = None) -> int:
        """Copy the transfers' device blocks into their host slots; returns bytes copied."""
        num_bytes = 0
        with self._on_copy_stream(after):
            for group_id, (slots, offsets, ids) in _by_group(transfers).items():
                if self.use_numpy:
                    self._store_numpy(group_id, slots.numpy(), offsets.numpy(), ids.numpy())
                else:
                    self._store_torch(group_id, slots, offsets, ids)
                num_bytes += len(ids) * self.layouts[group_id].block_bytes
        return num_bytes

    def _store_torch(self, group_id: int, slots: torch.Tensor, offsets: torch.Tensor,
                     ids: torch.Tensor) -> None:
        host, caches = self.slots[group_id], self.group_caches[group_id]
        ids = ids.to(caches[0].device)
        for layer, cache in enumerate(caches):
            # (2, n, bs, heads, hd) -> (n, 2, bs, heads, hd): one page per block
            host[slots, offsets, layer] = cache.index_select(1, ids).transpose(0, 1).cpu()

    def _store_numpy(self, group_id: int, slots: np.ndarray, offsets: np.ndarray,
                     ids: np.ndarray) -> None:
        host = self.slot_rows[group_id]
        for layer, cache in enumerate(self.cache_rows[group_id]):
            half = cache.shape[2]
            host[slots, offsets, layer, :half] = cache[0, ids]  # K rows of the blocks
            host[slots, offsets, layer, half:] = cache[1, ids]  # V rows

    @torch.inference_mode()
    def host_to_device(self, transfers: Sequence[ChunkTransfer]) -> int:
        """Copy the transfers' host pages into their device blocks; returns bytes copied."""
        num_bytes = 0
        with self._on_copy_stream(None):
            for group_id, (slots, offsets, ids) in _by_group(transfers).items():
                if self.use_numpy:
                    self._load_numpy(group_id, slots.numpy(), offsets.numpy(), ids.numpy())
                else:
                    self._load_torch(group_id, slots, offsets, ids)
                num_bytes += len(ids) * self.layouts[group_id].block_bytes
        return num_bytes

    def _load_torch(self, group_id: int, slots: torch.Tensor, offsets: torch.Tensor,
                    ids: torch.Tensor) -> None:
        host, caches = self.slots[group_id], self.group_caches[group_id]
        ids = ids.to(caches[0].device)
        for layer, cache in enumerate(caches):
            # (n, 2, bs, heads, hd) -> (2, n, bs, heads, hd), scattered to the block ids
            pages = host[slots, offsets, layer].to(cache.device, non_blocking=True)
            cache.index_copy_(1, ids, pages.transpose(0, 1))

    def _load_numpy(self, group_id: int, slots: np.ndarray, offsets: np.ndarray,
                    ids: np.ndarray) -> None:
        host = self.slot_rows[group_id]
        for layer, cache in enumerate(self.cache_rows[group_id]):
            half = cache.shape[2]
            cache[0, ids] = host[slots, offsets, layer, :half]
            cache[1, ids] = host[slots, offsets, layer, half:]

    def _on_copy_stream(self, after: torch.cuda.Event | None):
        if self.stream is None:
            return _NullContext()
        return _StreamScope(self.stream, after)


def _slots_view(host_bytes: torch.Tensor, slot_bytes: int, layout: ChunkLayout,
                cache: torch.Tensor) -> torch.Tensor:
    """The host area as (num_slots, blocks_per_chunk, num_layers, 2, bs, heads, hd) of the
    cache's dtype; a group whose chunk is smaller than a slot uses each slot's prefix."""
    _, _, block_size, num_kv_heads, head_dim = cache.shape
    num_slots = host_bytes.numel() // slot_bytes
    # (num_slots * slot_bytes,) uint8 -> (num_slots, chunk_bytes) -> elements of cache.dtype
    per_slot = host_bytes[:num_slots * slot_bytes].view(num_slots, slot_bytes)
    typed = per_slot[:, :layout.chunk_bytes].view(cache.dtype)
    return typed.view(num_slots, layout.blocks_per_chunk, layout.num_layers, 2, block_size,
                      num_kv_heads, head_dim)


def _slot_rows(host_area: np.ndarray, slot_bytes: int, layout: ChunkLayout) -> np.ndarray:
    """The host area as bytes (num_slots, blocks_per_chunk, num_layers, page_bytes)."""
    num_slots = host_area.size // slot_bytes
    return np.lib.stride_tricks.as_strided(
        host_area, shape=(num_slots, layout.blocks_per_chunk, layout.num_layers,
                          layout.page_bytes),
        strides=(slot_bytes, layout.block_bytes, layout.page_bytes, 1))


def _cache_rows(cache: torch.Tensor) -> np.ndarray:
    """A CPU cache as bytes (2, num_blocks, block bytes of K or V): one row per block half."""
    # (2, num_blocks, bs, heads, hd) -> (2, num_blocks, bs * heads * hd * itemsize) uint8
    return cache.view(torch.uint8).numpy().reshape(cache.shape[0], cache.shape[1], -1)


def _by_group(transfers: Sequence[ChunkTransfer]
              ) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """group id -> (slot, offset-in-chunk, device block id) of every block, as index tensors."""
    columns: dict[int, tuple[list[int], list[int], list[int]]] = defaultdict(
        lambda: ([], [], []))
    for transfer in transfers:
        slots, offsets, ids = columns[transfer.group_id]
        slots.extend([transfer.slot] * len(transfer.block_ids))
        offsets.extend(transfer.block_offsets)
        ids.extend(transfer.block_ids)
    return {group: tuple(torch.tensor(column) for column in cols)
            for group, cols in columns.items()}


class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class _StreamScope:
    """Run on `stream` after `after`; on exit wait for the stream (on the copy thread)."""

    def __init__(self, stream: torch.cuda.Stream, after: torch.cuda.Event | None) -> None:
        self.stream, self.after = stream, after
        self._scope = torch.cuda.stream(stream)

    def __enter__(self) -> None:
        if self.after is not None:
            self.stream.wait_event(self.after)
        self._scope.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._scope.__exit__(*exc)
        self.stream.synchronize()
