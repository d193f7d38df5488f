"""OffloadingConnector, worker half: moves chunk bytes between the paged cache and host slots.

One copy thread does every copy, so copies overlap sampling, scheduling and the next forward's
preparation without racing each other. Loads (host -> device) fill blocks that belong to a
request in WAITING_FOR_REMOTE_KVS, which no forward reads until the load is reported. Stores
(device -> host) read full blocks, which never change while allocated; a block can only be
reused after its request is freed, so the next step's `start_load_kv` first waits (with a
deadline) for the previous step's stores. That fence is why the scheduler half never has to
delay a free until `finished_sending`.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any

from kvtier.common.cpu_threads import use_one_cpu_thread
from kvtier.connector.base import ConnectorContext, KVConnectorWorker
from kvtier.connector.offloading.metadata import ChunkTransfer, OffloadingConnectorMetadata
from kvtier.connector.offloading.session import BatchDone, OffloadSession, find_session
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
        self._copy_thread = ThreadPoolExecutor(1, "kvtier-offload-copy",
                                               initializer=use_one_cpu_thread)
        self._session: OffloadSession | None = None
        self._copier: ChunkCopier | None = None
        self._stores: list[_StoreBatch] = []
        self._loads: dict[str, list[tuple[ChunkTransfer, Future]]] = {}
        self._load_errors: set[int] = set()
        self._fence_timeout_s = float(config.kv_load_timeout_s)

    def bind_connector_metadata(self, metadata: OffloadingConnectorMetadata) -> None:
        super().bind_connector_metadata(metadata)
        if self._session is None:
            self._session = find_session(metadata.session_id)
            self._copier = self._make_copier(self._session)

    def _make_copier(self, session: OffloadSession) -> ChunkCopier:
        groups = self.context.kv_cache_config.kv_cache_groups
        group_caches = [[self.kv_caches[name] for name in group.layer_names] for group in groups]
        area = session.manager.area
        return ChunkCopier(area.buffer, area.slot_bytes, group_caches, session.layouts)

    def start_load_kv(self, forward_context: Any) -> None:
        self._fence_stores()
        loads = self.connector_metadata.loads
        copies = [transfer for transfer in loads if transfer.slot is not None]
        batch = self._copy_thread.submit(self._run_loads, copies) if copies else _failed()
        for transfer in loads:
            outcome = batch if transfer.slot is not None else _failed()
            self._loads.setdefault(transfer.req_id, []).append((transfer, outcome))

    def wait_for_save(self) -> None:
        stores = self.connector_metadata.stores
        if not stores:
            return
        abandoned = threading.Event()
        after = self._copier.record_compute()
        future = self._copy_thread.submit(self._run_stores, stores, abandoned, after)
        self._stores.append(_StoreBatch(future, abandoned))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        received = set()
        for req_id, items in list(self._loads.items()):
            if not all(future.done() for _, future in items):
                continue
            for transfer, future in items:
                if future.exception() is not None or not future.result():
                    self._load_errors.update(transfer.block_ids)
            received.add(req_id)
            del self._loads[req_id]
        return set(), received

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self._copy_thread.shutdown(wait=True, cancel_futures=False)

    # ---- on the copy thread ----------------------------------------------------------------

    def _run_loads(self, loads: list[ChunkTransfer]) -> bool:
        """Copy every load of one step; False if the copy failed (all its blocks are bad)."""
        start = time.monotonic()
        try:
            num_bytes = self._copier.host_to_device(loads)
        except Exception:  # a failed copy is a load error; the requests recompute
            return False
        ended = time.monotonic()
        self._session.completions.put(BatchDone("host_to_device", (), True, num_bytes,
                                                ended - start, ended))
        return True

    def _run_stores(self, stores: list[ChunkTransfer], abandoned: threading.Event,
                    after: Any) -> None:
        start, num_bytes = time.monotonic(), 0
        try:
            num_bytes = self._copier.device_to_host(stores, after)
            ok = True
        except Exception:  # the chunks are not stored; nothing else is affected
            ok = False
        ok = ok and not abandoned.is_set()
        ended = time.monotonic()
        self._session.completions.put(BatchDone(
            "device_to_host", tuple(t.job_id for t in stores), ok, num_bytes, ended - start,
            ended))

    def _fence_stores(self) -> None:
        if not self._stores:
            return
        pending = [batch.future for batch in self._stores]
        _, not_done = wait_futures(pending, timeout=self._fence_timeout_s)
        for batch in self._stores:
            if batch.future in not_done:
                batch.abandoned.set()
        self._stores = []


def _failed() -> Future:
    """The outcome of a load that cannot happen (its chunk left the host tier)."""
    future: Future = Future()
    future.set_result(False)
    return future
