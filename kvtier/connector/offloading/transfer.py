"""Device <-> host copies of chunks between the paged KV cache and the host area.

Paged cache, per layer: (parts, num_blocks, ...) with the page of a block split in `parts`:
attention (2, num_blocks, block_size, num_kv_heads, head_dim), K at [0], V at [1]; a recurrent
state (1, num_blocks, *state shape). Host slot (standard layout, kvtier.offload.layout):
(blocks_per_chunk, num_layers, page) with page = its parts in order (K then V), each
contiguous.

Every byte is copied once, straight between the cache and the host area (or, for a load from a
tier's mapped file, straight from that file's pages in memory): no staging buffer.
A step's blocks are first cut into runs (consecutive device block ids landing on consecutive
host pages, common since the block pool hands out blocks in order), and each run is one strided
copy per layer whatever its length. On CPU the copies are numpy assignments between byte views
(block, part, bytes) whose rows are contiguous, so numpy copies row by row and releases the GIL
while it runs; torch's CPU copies of such views cost more per call. (Views with one void element
per half-page, tried first, were 3x slower and held the GIL: the engine thread stalled behind
every store.) The torch path serves any device: it gathers the blocks on the device into the
host's block-major order (on CUDA on a side stream that first waits for the compute stream; the
copy thread then waits for that stream), then moves each run with one copy into its contiguous
host range. Tests check the two paths agree byte for byte.

Loads into a CPU cache go to the C++ kernel `load_pages` where it is built: every (block,
layer) page of the load in one call on the engine's threads. Numpy's one call per run and layer
cost ~1.3 us each beyond its bytes, which an 8k-token host hit into scattered blocks (15,330
pages of 12 KB) paid 19 ms of, on one thread.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from kvtier.connector.offloading.metadata import ChunkTransfer
from kvtier.models import cpu_kernels
from kvtier.offload.layout import ChunkLayout

# Most bytes one device-side gather of the torch path holds at once (bounds its device memory).
_GATHER_BYTES = 64 * 2**20


class _Run(NamedTuple):
    """Blocks `first_block ..` of the device cache <-> consecutive host pages from a byte offset."""

    host_offset: int
    first_block: int
    num_blocks: int


class ChunkCopier:
    def __init__(self, host_area: np.ndarray, slot_bytes: int,
                 group_caches: Sequence[Sequence[torch.Tensor]],
                 layouts: Sequence[ChunkLayout], use_numpy: bool | None = None,
                 use_kernel: bool | None = None) -> None:
        """`use_numpy`: None picks the numpy path for CPU caches (False forces torch's).
        `use_kernel`: on the numpy path, loads through the C++ `load_pages` (None: where it
        is built; False: numpy's copies)."""
        self.host_area = host_area
        self.host_bytes = torch.from_numpy(host_area)
        self.slot_bytes = slot_bytes
        self.group_caches = group_caches
        self.layouts = layouts
        device = group_caches[0][0].device
        self.use_numpy = device.type == "cpu" if use_numpy is None else use_numpy
        # Per group: the load_pages kernel, or None (numpy or torch copies).
        self.page_loaders: list[Callable[..., None] | None] = [None] * len(group_caches)
        if self.use_numpy:
            self.cache_parts = [[_cache_parts(cache) for cache in caches]
                                for caches in group_caches]
            kernels = cpu_kernels.ops() if use_kernel is not False else None
            if use_kernel and kernels is None:
                raise ValueError("use_kernel=True, but the C++ CPU kernels are not built")
            if kernels is not None:  # the kernel takes whole (contiguous) caches
                self.page_loaders = [kernels.load_pages if all(c.is_contiguous() for c in caches)
                                     else None for caches in group_caches]
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
            for (group_id, _), runs in self._runs_by_group(transfers).items():
                if self.use_numpy:
                    self._store_numpy(group_id, runs)
                else:
                    for batch in self._batches(group_id, runs):
                        self._store_torch(group_id, batch)
                num_bytes += _num_blocks(runs) * self.layouts[group_id].block_bytes
        return num_bytes

    @torch.inference_mode()
    def host_to_device(self, transfers: Sequence[ChunkTransfer]) -> int:
        """Copy the transfers' host (or mapped file) pages into their device blocks; returns
        bytes copied."""
        num_bytes = 0
        with self._on_copy_stream(None):
            for (group_id, mapping), runs in self._runs_by_group(transfers).items():
                source = self.host_bytes if mapping is None else mapping.tensor
                if self.page_loaders[group_id] is not None:
                    self._load_kernel(group_id, runs, source)
                elif self.use_numpy:
                    self._load_numpy(group_id, runs, source.numpy())
                else:
                    for batch in self._batches(group_id, runs):
                        self._load_torch(group_id, batch, source)
                num_bytes += _num_blocks(runs) * self.layouts[group_id].block_bytes
        return num_bytes

    def _store_numpy(self, group_id: int, runs: list[_Run]) -> None:
        for run in runs:
            pages = self._host_parts(group_id, run, self.host_area)
            for layer, cache in enumerate(self.cache_parts[group_id]):
                pages[:, layer] = cache[run.first_block:run.first_block + run.num_blocks]

    def _load_numpy(self, group_id: int, runs: list[_Run], source: np.ndarray) -> None:
        for run in runs:
            pages = self._host_parts(group_id, run, source)
            for layer, cache in enumerate(self.cache_parts[group_id]):
                cache[run.first_block:run.first_block + run.num_blocks] = pages[:, layer]

    def _load_kernel(self, group_id: int, runs: list[_Run], source: torch.Tensor) -> None:
        block_bytes = self.layouts[group_id].block_bytes
        offsets = [run.host_offset + i * block_bytes for run in runs
                   for i in range(run.num_blocks)]
        load_pages = self.page_loaders[group_id]
        load_pages(source, torch.tensor(offsets, dtype=torch.int64),
                   _block_ids(runs, torch.device("cpu")), list(self.group_caches[group_id]))

    def _host_parts(self, group_id: int, run: _Run, buffer: np.ndarray) -> np.ndarray:
        """The run's host (`buffer`) pages as (num_blocks, num_layers, parts, part bytes)."""
        layout = self.layouts[group_id]
        parts = self.group_caches[group_id][0].shape[0]
        part = layout.page_bytes // parts
        return np.ndarray((run.num_blocks, layout.num_layers, parts, part), dtype=np.uint8,
                          buffer=buffer, offset=run.host_offset,
                          strides=(layout.block_bytes, layout.page_bytes, part, 1))

    def _store_torch(self, group_id: int, runs: list[_Run]) -> None:
        caches = self.group_caches[group_id]
        ids = _block_ids(runs, caches[0].device)
        # L x (parts, n, *part) -> (L, parts, n, ...) -> (n, L, parts, ...): the host's order
        pages = torch.stack([cache.index_select(1, ids) for cache in caches])
        pages = pages.permute(2, 0, 1, *range(3, pages.dim())).contiguous()
        start = 0
        for run in runs:
            self._host_run(group_id, run, self.host_bytes).copy_(
                pages[start:start + run.num_blocks])
            start += run.num_blocks

    def _load_torch(self, group_id: int, runs: list[_Run], source: torch.Tensor) -> None:
        caches = self.group_caches[group_id]
        ids = _block_ids(runs, caches[0].device)
        # (n, L, parts, *part) on the device, filled run by run from the host
        pages = torch.empty((len(ids), len(caches), *caches[0].shape[:1], *caches[0].shape[2:]),
                            dtype=caches[0].dtype, device=caches[0].device)
        start = 0
        for run in runs:
            pages[start:start + run.num_blocks].copy_(self._host_run(group_id, run, source),
                                                      non_blocking=True)
            start += run.num_blocks
        for layer, cache in enumerate(caches):
            # (n, parts, *part) -> (parts, n, *part), scattered to the block ids; an fp8 cache
            # as its bytes (no index_copy_ kernel takes fp8 on the CPU)
            source = pages[:, layer].transpose(0, 1)
            if cache.element_size() == 1:
                cache, source = cache.view(torch.uint8), source.view(torch.uint8)
            cache.index_copy_(1, ids, source)

    def _host_run(self, group_id: int, run: _Run, source: torch.Tensor) -> torch.Tensor:
        """The run's host (`source`) bytes as (num_blocks, num_layers, parts, *part) of the
        cache dtype."""
        cache = self.group_caches[group_id][0]
        layout = self.layouts[group_id]
        raw = source[run.host_offset:run.host_offset + run.num_blocks * layout.block_bytes]
        return raw.view(cache.dtype).view(run.num_blocks, layout.num_layers, cache.shape[0],
                                          *cache.shape[2:])

    def _batches(self, group_id: int, runs: list[_Run]) -> list[list[_Run]]:
        block_bytes = self.layouts[group_id].block_bytes
        return _batches(runs, max(1, _GATHER_BYTES // block_bytes), block_bytes)

    def _runs_by_group(self, transfers: Sequence[ChunkTransfer]) -> dict[tuple[int, Any],
                                                                         list[_Run]]:
        """(group id, mapped file or None: the host area) -> the transfers' blocks as runs (at
        byte offsets of that source), in transfer order."""
        runs: dict[tuple[int, Any], list[_Run]] = defaultdict(list)
        for transfer in transfers:
            block_bytes = self.layouts[transfer.group_id].block_bytes
            mapped = transfer.mapped
            group_runs = runs[(transfer.group_id, None if mapped is None else mapped.mapping)]
            base = transfer.slot * self.slot_bytes if mapped is None else mapped.offset
            for offset, block_id in zip(transfer.block_offsets, transfer.block_ids):
                host_offset = base + offset * block_bytes
                last = group_runs[-1] if group_runs else None
                if (last is not None
                        and host_offset == last.host_offset + last.num_blocks * block_bytes
                        and block_id == last.first_block + last.num_blocks):
                    group_runs[-1] = last._replace(num_blocks=last.num_blocks + 1)
                else:
                    group_runs.append(_Run(host_offset, block_id, 1))
        return runs

    def _on_copy_stream(self, after: torch.cuda.Event | None):
        if self.stream is None:
            return _NullContext()
        return _StreamScope(self.stream, after)


def _cache_parts(cache: torch.Tensor) -> np.ndarray:
    """A CPU cache as (num_blocks, parts, part bytes): e.g. the K and V bytes of each block."""
    # (parts, num_blocks, *part) -> (parts, num_blocks, part bytes) uint8 -> block-major view
    rows = cache.view(torch.uint8).numpy().reshape(cache.shape[0], cache.shape[1], -1)
    return rows.transpose(1, 0, 2)


def _num_blocks(runs: list[_Run]) -> int:
    return sum(run.num_blocks for run in runs)


def _block_ids(runs: list[_Run], device: torch.device) -> torch.Tensor:
    ids = [run.first_block + i for run in runs for i in range(run.num_blocks)]
    return torch.tensor(ids, device=device)


def _batches(runs: list[_Run], max_blocks: int, block_bytes: int) -> list[list[_Run]]:
    """The runs cut into batches of at most `max_blocks` blocks (a long run is split)."""
    batches: list[list[_Run]] = [[]]
    room = max_blocks
    for run in runs:
        while run.num_blocks > 0:
            if room == 0:
                batches.append([])
                room = max_blocks
            take = min(room, run.num_blocks)
            batches[-1].append(run._replace(num_blocks=take))
            run = _Run(run.host_offset + take * block_bytes, run.first_block + take,
                       run.num_blocks - take)
            room -= take
    return batches


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
