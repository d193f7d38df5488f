"""OffloadingConnector, worker half: moves chunk bytes between the paged cache and host slots.

It needs nothing but what the engine hands it: the host area and chunk layouts in
`context.shared`, the paged KV tensors, and each step's metadata. Every copy it finishes goes
back to the scheduler half in its `OffloadingConnectorReport`.

Loads (host -> device) are synchronous: the scheduler half plans one only for chunks already in
host memory (or pinned in a tier's mapped file), so `start_load_kv` copies them on the engine
thread before the forward that reads them, and a host hit costs no more scheduler steps than a
device hit. A mapped chunk was found in memory by the lookup of this same step (see
offload/tiers/slot_file.py). A load that cannot happen (its chunk left host memory since the
lookup) or fails reports its blocks as load errors; the scheduler recomputes from there. Stores
(device -> host) run on one copy thread, so they overlap sampling, scheduling and the next
forward's preparation. They read full blocks, which never change while allocated; a block can
only be reused after its request is freed, so the next step's `start_load_kv` first waits (with
a deadline) for the previous step's stores. That fence is why the scheduler half never has to
delay a free until `finished_sending`, and why no store runs while a load writes.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any

from kvtier.common.cpu_threads import use_one_cpu_thread
from kvtier.common.daemon_threads import DaemonThreadPool
from kvtier.connector.base import TRANSFER_POLL_S, ConnectorContext, KVConnectorWorker
from kvtier.connector.offloading.metadata import (
    BatchDone,
    ChunkTransfer,
    Direction,
    OffloadingConnectorMetadata,
    OffloadingConnectorReport,
)
from kvtier.connector.offloading.shared import shared_of
from kvtier.connector.offloading.transfer import ChunkCopier


@dataclass
class _StoreBatch:
    future: Future
    # Set when the fence gave up waiting: the copy may have read reused blocks, so its result
    # is reported as failed whenever it ends.
    abandoned: threading.Event


class OffloadingConnectorWorker(KVConnectorWorker):
    def __init__(self, config: Any, context: ConnectorContext) -> None:
        super().__init__(config, context)
        self.shared = shared_of(context)
        self._copy_thread = DaemonThreadPool(1, "kvtier-offload-copy",
                                             initializer=use_one_cpu_thread)
        self._copier: ChunkCopier | None = None
        self._stores: list[_StoreBatch] = []
        self._load_errors: set[int] = set()
        # Batches the copy thread finished, until the next report takes them.
        self._done: queue.SimpleQueue[BatchDone] = queue.SimpleQueue()
        # The store fence and the copies still queued at shutdown wait this long at most.
        self._timeout_s = float(config.kv_load_timeout_s)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        groups = self.context.kv_cache_config.kv_cache_groups
        group_caches = [[kv_caches[name] for name in group.layer_names] for group in groups]
        area = self.shared.area
        self._copier = ChunkCopier(area.buffer, area.slot_bytes, group_caches,
                                   self.shared.layouts)

    @property
    def connector_metadata(self) -> OffloadingConnectorMetadata:
        metadata = super().connector_metadata
        assert isinstance(metadata, OffloadingConnectorMetadata)
        return metadata

    def start_load_kv(self, forward_context: Any) -> None:
        self._fence_stores()
        batches: dict[Direction, list[ChunkTransfer]] = defaultdict(list)
        for transfer in self.connector_metadata.loads:
            if transfer.slot is not None:
                batches["host_to_device"].append(transfer)
            elif transfer.mapped is not None:
                batches[f"{transfer.mapped.owner.context.name}_to_device"].append(transfer)
            else:
                self._load_errors.update(transfer.block_ids)
        for direction, loads in batches.items():
            if not self._run_loads(direction, loads):
                for transfer in loads:
                    self._load_errors.update(transfer.block_ids)

    def wait_for_save(self) -> None:
        stores = self.connector_metadata.stores
        if not stores:
            return
        abandoned = threading.Event()
        after = self._copier.record_compute()
        future = self._copy_thread.submit(self._run_stores, stores, abandoned, after)
        self._stores.append(_StoreBatch(future, abandoned))

    def wait_for_transfers(self, timeout_s: float) -> None:
        # Until a waiting request's promotions are all in host memory (see PromotionWatch).
        self.shared.watch.wait(timeout_s, TRANSFER_POLL_S)

    def interrupt_wait(self) -> None:
        self.shared.watch.interrupt()

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_report(self) -> OffloadingConnectorReport | None:
        batches = []
        while not self._done.empty():
            batches.append(self._done.get_nowait())
        return OffloadingConnectorReport(batches) if batches else None

    def shutdown(self) -> None:
        # The copies already queued still run (their stores are this instance's work) until
        # the deadline; the last report then carries them to the scheduler half.
        self._copy_thread.shutdown(self._timeout_s)

    def _run_loads(self, direction: Direction, loads: list[ChunkTransfer]) -> bool:
        """Copy one step's loads from one source; False if the copy failed (all its blocks are
        bad)."""
        start, num_bytes = time.monotonic(), 0
        try:
            num_bytes = self._copier.host_to_device(loads)
            ok = True
        except Exception:  # a failed copy is a load error; the requests recompute
            ok = False
        self._report(direction, loads, ok, num_bytes, start)
        return ok

    # ---- on the copy thread ----------------------------------------------------------------

    def _run_stores(self, stores: list[ChunkTransfer], abandoned: threading.Event,
                    after: Any) -> None:
        start, num_bytes = time.monotonic(), 0
        try:
            num_bytes = self._copier.device_to_host(stores, after)
            ok = True
        except Exception:  # the chunks are not stored; nothing else is affected
            ok = False
        self._report("device_to_host", stores, ok and not abandoned.is_set(), num_bytes, start)

    def _report(self, direction: Direction, transfers: list[ChunkTransfer], ok: bool,
                num_bytes: int, start: float) -> None:
        ended = time.monotonic()
        self._done.put(BatchDone(direction, tuple(t.job_id for t in transfers), ok, num_bytes,
                                 ended - start, ended))

    def _fence_stores(self) -> None:
        if not self._stores:
            return
        pending = [batch.future for batch in self._stores]
        _, not_done = wait_futures(pending, timeout=self._timeout_s)
        for batch in self._stores:
            if batch.future in not_done:
                batch.abandoned.set()
        self._stores = []
