"""ExampleConnector: the reference connector, one file per KV block in a shared directory.

Read this file to write your own connector. It shows the whole lifecycle:

* scheduler half: `get_num_new_matched_tokens` counts the request's next blocks that have a file;
  `update_state_after_alloc` remembers the blocks the scheduler allocated for them;
  `build_connector_meta` turns that into this step's loads, plus saves of every block that
  becomes full of computed KV this step;
* worker half: `start_load_kv` copies files into the paged cache on a background thread and
  `get_finished` reports the request in `finished_recving` when its load is done; bad or missing
  files come back through `get_block_ids_with_load_errors`; `wait_for_save` copies this step's
  full blocks out of the paged cache and writes them on another thread.

A block's file is named by its chained block hash (which covers the whole prefix) under a
directory named by the engine's namespace digest, so any later request or any other process
running the same weights with the same prefix finds it; `<namespace hex>.json` in that directory
says what the namespace covers. Each file is a checked chunk (offload/chunk_format.py: header
with the namespace and block hash as its key, length and checksum) whose payload is the block of
every layer in turn, each (2, block_size, kv_heads, head_dim) in the cache's dtype. A file that
fails the check is a failed load (counted, and recomputed per kv_load_failure_policy), never
data; nothing is unpickled. Writes go to a temporary file renamed into place, so a reader never
sees half a block. With a chunk secret (`secret_file`, or $KVTIER_CHUNK_SECRET_FILE /
$KVTIER_CHUNK_SECRET) every file carries a MAC and one without a valid MAC is a failed load.
Files are opened without following symlinks (offload/safe_dir.py), created 0600 in a 0700
directory. The I/O threads are daemon threads: a write hung past `flush_timeout_s` at shutdown
never holds the process.

Extra config: {"shared_storage_path": DIR, "flush_timeout_s": 30.0, "secret_file": null}.
Models with one KV cache group only (all layers full attention, or all the same sliding window).
"""

from __future__ import annotations

import concurrent.futures
import os
import stat
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvtier.common.cpu_threads import use_one_cpu_thread
from kvtier.common.daemon_threads import DaemonThreadPool
from kvtier.connector.base import (
    ConnectorContext,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorScheduler,
    KVConnectorWorker,
)
from kvtier.connector.config import KVTransferConfig, parse_options
from kvtier.connector.counters import ConnectorCounters
from kvtier.offload.chunk_format import (
    FORMAT_NAME,
    ChunkFormatError,
    drop_bad_file,
    load_chunk_secret,
    read_chunk_into,
    write_chunk,
    write_description,
)
from kvtier.offload.safe_dir import open_file, opened_dir, write_atomically

if TYPE_CHECKING:
    from kvtier.kv import KVCacheBlocks, Request

# Seconds shutdown gives a load in flight (loads are not waited for: no one needs them then).
_LOAD_GRACE_S = 0.5


@dataclass(frozen=True)
class ExampleConnectorOptions:
    shared_storage_path: str
    # Deadline for writes still in flight when the engine shuts down.
    flush_timeout_s: float = 30.0
    # File holding the secret that authenticates the block files (offload/chunk_format.py).
    secret_file: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.shared_storage_path, str) or not self.shared_storage_path:
            raise ValueError("ExampleConnector extra config: shared_storage_path must be a "
                             f"directory path, got {self.shared_storage_path!r}")
        if not isinstance(self.flush_timeout_s, (int, float)) or self.flush_timeout_s <= 0:
            raise ValueError("ExampleConnector extra config: flush_timeout_s must be a number "
                             f"of seconds > 0, got {self.flush_timeout_s!r}")
        if self.secret_file is not None and (not isinstance(self.secret_file, str)
                                             or not self.secret_file):
            raise ValueError("ExampleConnector extra config: secret_file must be a file path, "
                             f"got {self.secret_file!r}")


def _parse_options(config: KVTransferConfig) -> ExampleConnectorOptions:
    return parse_options(ExampleConnectorOptions, config.kv_connector_extra_config,
                         "ExampleConnector extra config")


class BlockFiles:
    """Names the file of each block, <root>/<namespace hex>/<block hash>.kv, and its key."""

    def __init__(self, root: str, namespace: bytes) -> None:
        self.namespace = namespace
        self.directory = os.path.join(root, namespace.hex())

    def name(self, block_hash: bytes) -> str:
        return block_hash.hex() + ".kv"

    def path(self, block_hash: bytes) -> str:
        return os.path.join(self.directory, self.name(block_hash))

    def key(self, block_hash: bytes) -> bytes:
        """What a file's header must name: a file never passes for another model's or block's."""
        return self.namespace + block_hash

    def exists(self, block_hash: bytes) -> bool:
        try:
            return stat.S_ISREG(os.stat(self.path(block_hash), follow_symlinks=False).st_mode)
        except OSError:
            return False


@dataclass(frozen=True)
class BlockTransfer:
    """One block moved between the paged cache (by id) and its file (by hash)."""

    block_id: int
    block_hash: bytes


@dataclass
class ExampleConnectorMetadata(KVConnectorMetadata):
    # request id -> the blocks to fill for it; the request is reported once all are tried.
    loads: dict[str, list[BlockTransfer]] = field(default_factory=dict)
    saves: list[BlockTransfer] = field(default_factory=list)


class ExampleConnectorScheduler(KVConnectorScheduler):
    """Decides which blocks to load and save; touches only the file names, never the bytes."""

    def __init__(self, config: KVTransferConfig, context: ConnectorContext) -> None:
        super().__init__(config, context)
        context.require_one_kv_cache_group("ExampleConnector")
        self.files = BlockFiles(_parse_options(config).shared_storage_path, context.namespace)
        self._requests: dict[str, Request] = {}
        self._block_ids: dict[str, list[int]] = {}
        self._num_saved_blocks: dict[str, int] = {}
        # request id -> number of blocks to load, set at allocation, sent at the next build.
        self._pending_loads: dict[str, int] = {}

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.config.is_consumer:
            return 0, False
        block_size = self.context.block_size
        # The last token is always computed: the model needs its logits to sample.
        last_block = (request.num_tokens - 1) // block_size
        num_hits = 0
        for block_hash in request.block_hashes[num_computed_tokens // block_size:last_block]:
            if not self.files.exists(block_hash):
                break
            num_hits += 1
        return num_hits * block_size, num_hits > 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        block_ids = blocks.get_block_ids()
        self._requests[request.request_id] = request
        self._block_ids[request.request_id] = list(block_ids[0])
        if num_external_tokens > 0:
            self._pending_loads[request.request_id] = num_external_tokens // self.context.block_size

    def build_connector_meta(self, scheduler_output: Any) -> ExampleConnectorMetadata:
        meta = ExampleConnectorMetadata(loads=self._take_loads())
        for new_req in scheduler_output.scheduled_new_reqs:
            self._block_ids[new_req.req_id] = list(new_req.block_ids[0])
        for cached_req in scheduler_output.scheduled_cached_reqs:
            self._block_ids.setdefault(cached_req.req_id, []).extend(cached_req.new_block_ids[0])
        if self.config.is_producer:
            meta.saves = self._collect_saves(scheduler_output)
        return meta

    def _take_loads(self) -> dict[str, list[BlockTransfer]]:
        loads = {}
        for req_id, num_blocks in self._pending_loads.items():
            request, block_ids = self._requests[req_id], self._block_ids[req_id]
            # The scheduler has set num_computed_tokens to local hit + external tokens.
            end = request.num_computed_tokens // self.context.block_size
            loads[req_id] = [BlockTransfer(block_ids[i], request.block_hashes[i])
                             for i in range(end - num_blocks, end)]
        self._pending_loads.clear()
        return loads

    def _collect_saves(self, scheduler_output: Any) -> list[BlockTransfer]:
        saves: dict[bytes, BlockTransfer] = {}
        for data in [*scheduler_output.scheduled_new_reqs,
                     *scheduler_output.scheduled_cached_reqs]:
            num_computed = (data.num_computed_tokens
                            + scheduler_output.num_scheduled_tokens[data.req_id])
            for block in self._new_full_blocks(data.req_id, num_computed):
                # Requests sharing a prefix in one step would write the same file twice.
                saves.setdefault(block.block_hash, block)
        return list(saves.values())

    def _new_full_blocks(self, req_id: str, num_computed_tokens: int) -> list[BlockTransfer]:
        """Blocks of `req_id` full of computed KV after this step and not saved yet."""
        request = self._requests.get(req_id)
        if request is None:
            return []
        start = self._num_saved_blocks.get(req_id, 0)
        end = min(num_computed_tokens // self.context.block_size, len(request.block_hashes))
        self._num_saved_blocks[req_id] = max(start, end)
        block_ids = self._block_ids[req_id]
        return [BlockTransfer(block_ids[i], request.block_hashes[i]) for i in range(start, end)
                if not self.files.exists(request.block_hashes[i])]

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Saves copy their blocks out in wait_for_save, so the blocks can be freed at once.
        for state in (self._requests, self._block_ids, self._num_saved_blocks,
                      self._pending_loads):
            state.pop(request.request_id, None)
        return False, None


class ExampleConnectorWorker(KVConnectorWorker):
    """Moves blocks between the paged cache and the files, off the forward pass's thread."""

    def __init__(self, config: KVTransferConfig, context: ConnectorContext) -> None:
        super().__init__(config, context)
        self.options = _parse_options(config)
        self.files = BlockFiles(self.options.shared_storage_path, context.namespace)
        self._secret = load_chunk_secret(self.options.secret_file)
        # Separate threads so that a slow write never delays a load.
        self._loader = DaemonThreadPool(1, "example-connector-load",
                                        initializer=use_one_cpu_thread)
        self._saver = DaemonThreadPool(1, "example-connector-save",
                                       initializer=use_one_cpu_thread)
        self._loads: dict[str, tuple[concurrent.futures.Future, list[BlockTransfer]]] = {}
        # One block of every layer, as bytes; reused by the single load thread.
        self._load_buffer: torch.Tensor | None = None
        self._described = False
        self._saves: list[concurrent.futures.Future] = []
        self._load_errors: set[int] = set()
        self._counts = ConnectorCounters(
            "example_connector", "ExampleConnector",
            ("blocks_loaded", "blocks_saved", "load_errors", "save_errors"), context.metrics)

    def start_load_kv(self, forward_context: Any) -> None:
        loads = self.connector_metadata.loads
        deadline = time.monotonic() + self.config.kv_load_timeout_s
        for req_id, blocks in loads.items():
            future = self._loader.submit(self._load_blocks, blocks, deadline)
            self._loads[req_id] = (future, blocks)

    def _load_blocks(self, blocks: list[BlockTransfer], deadline: float) -> set[int]:
        """Fill the blocks from their files; returns the ids of the blocks that failed."""
        failed = set()
        # Inference mode as in the forward pass: the caches may be inference tensors.
        with torch.inference_mode():
            for block in blocks:
                # Past the deadline the scheduler gives up on these blocks: leave them alone.
                if time.monotonic() > deadline or not self._load_block(block):
                    failed.add(block.block_id)
        return failed

    def _load_block(self, block: BlockTransfer) -> bool:
        if self._load_buffer is None:
            num_bytes = sum(cache[:, 0].nbytes for cache in self.kv_caches.values())
            self._load_buffer = torch.empty(num_bytes, dtype=torch.uint8)
        buffer = self._load_buffer
        name = self.files.name(block.block_hash)
        try:
            with opened_dir(self.files.directory) as dir_fd, \
                    os.fdopen(open_file(name, dir_fd, os.O_RDONLY), "rb") as f:
                try:
                    read_chunk_into(f, self.files.key(block.block_hash),
                                    memoryview(buffer.numpy()), self._secret)
                except ChunkFormatError:
                    drop_bad_file(f, name, dir_fd)  # else no save would ever replace it
                    raise
        except (OSError, ChunkFormatError):
            return False  # missing, unreadable, damaged, or another block's or model's file
        start = 0
        for cache in self.kv_caches.values():
            block_kv = cache[:, block.block_id]  # (2, block_size, kv_heads, head_dim)
            end = start + block_kv.nbytes
            block_kv.copy_(buffer[start:end].view(cache.dtype).view(block_kv.shape))
            start = end
        return True

    def wait_for_save(self) -> None:
        for block in self.connector_metadata.saves:
            # Copy now: once this step ends the scheduler may hand the block to another request.
            payload = torch.cat([cache[:, block.block_id].reshape(-1).view(torch.uint8)
                                 for cache in self.kv_caches.values()]).to("cpu")
            self._saves.append(self._saver.submit(self._write, block.block_hash, payload))

    def _write(self, block_hash: bytes, payload: torch.Tensor) -> None:
        os.makedirs(self.files.directory, 0o700, exist_ok=True)
        if not self._described:
            write_description(self.files.directory, self.files.namespace,
                              {**self.context.kv_identity.describe(), "format": FORMAT_NAME})
            self._described = True
        key, data = self.files.key(block_hash), memoryview(payload.numpy())
        with opened_dir(self.files.directory) as dir_fd:
            write_atomically(self.files.name(block_hash), dir_fd,
                             lambda f: write_chunk(f, key, data, self._secret))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        finished_recving = set()
        for req_id, (future, blocks) in list(self._loads.items()):
            if not future.done():
                continue
            del self._loads[req_id]
            failed = ({block.block_id for block in blocks} if future.exception() is not None
                      else future.result())
            self._load_errors |= failed
            self._counts.add("blocks_loaded", len(blocks) - len(failed))
            self._counts.add("load_errors", len(failed))
            finished_recving.add(req_id)
        for future in [f for f in self._saves if f.done()]:
            self._saves.remove(future)
            self._counts.add("save_errors" if future.exception() is not None else "blocks_saved")
        return set(), finished_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_stats(self) -> dict[str, float]:
        """Counts since the last call."""
        return self._counts.take()

    def shutdown(self) -> None:
        # Another process may be waiting for these files: give pending writes a deadline, and
        # abandon a write hung past it (a daemon thread: it ends with the process).
        self._saver.shutdown(self.options.flush_timeout_s)
        self._loader.shutdown(_LOAD_GRACE_S, cancel_pending=True)


class ExampleConnector(KVConnectorBase):
    scheduler_cls = ExampleConnectorScheduler
    worker_cls = ExampleConnectorWorker
