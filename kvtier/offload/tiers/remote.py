"""What the tiers on a network store (obj, redis) share: non-blocking lookups, a store that is
down costing misses, and request metrics.

A lookup must not wait on the network, so it answers from an in-memory index of the chunks this
instance knows are in the store (it wrote them, loaded them, or an existence check found them).
A key the index does not know is queued for an existence check on a probe thread and the lookup
answers UNKNOWN; the scheduler asks again next step and by then the answer is in the index (a
hit) or in a short-lived absent list (a miss). The checks of one step go out as one batch.

When a call finds the store unable to answer (`_is_outage`: connection refused, a timeout, a
server error), the store counts as down for `_DOWN_S`: lookups answer NOT_FOUND and jobs fail
at once, so a dead or stalled store costs misses, not waits. After that the next call tries
again; the clients reconnect by themselves, so hits resume without a restart. A request the
store refuses (out of memory, a wrong type, access denied) fails that job alone, counted: the
other chunks are still there, and a full store must not turn its hits into misses.

Every chunk is written in the checked format of offload/chunk_format.py: a value that is not
this key's chunk (garbage, another key's, truncated, too long) fails its load, is deleted and is
recomputed. A load reads at most one byte past the longest valid value, so a huge value planted
under a chunk's name costs a failed load, not the process's memory. A value that is intact but
fails this instance's MAC check (written by an instance with another chunk secret, or none) is
a miss and stays: one misconfigured instance must not wipe the pool the others share.
"""

from __future__ import annotations

import io
import queue
import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvtier.common.bounded import BoundedDict
from kvtier.common.daemon_threads import DaemonThreadPool
from kvtier.common.options import is_positive_int, require
from kvtier.offload.chunk_format import (
    HEADER_BYTES,
    MAC_BYTES,
    ChunkFormatError,
    encode_header,
    is_foreign_chunk,
    read_chunk_into,
)
from kvtier.offload.keys import ChunkKey
from kvtier.offload.tiers.base import Locality, LookupResult, TierContext, TransferJob
from kvtier.offload.tiers.threaded import ThreadedTier, check_thread_options

# Seconds a failed call marks the store down (no probes, jobs fail at once).
_DOWN_S = 1.0
# Seconds an existence check's "absent" answer is trusted: long enough for the request that
# asked to see it, short enough that a chunk another instance stores soon becomes a hit.
_ABSENT_S = 2.0
# Keys one existence-check batch may carry.
_PROBE_BATCH = 256
# Latency buckets of one store call: a local round trip up to a client timeout.
_REQUEST_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                    5.0, 10.0)

T = TypeVar("T")


class MissingChunk(Exception):
    """The store has no value under the chunk's name (evicted, expired or deleted)."""


def check_remote_options(options: Any, where: str) -> None:
    """Validate the fields every remote tier's options share."""
    check_thread_options(options, where)
    for name in ("connect_timeout_s", "timeout_s"):
        value = getattr(options, name)
        require(isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
                f"{where}.{name}", "must be a number of seconds > 0", value)
    require(is_positive_int(options.max_index_entries), f"{where}.max_index_entries",
            "must be an integer >= 1", options.max_index_entries)
    require(is_positive_int(options.max_pending_checks), f"{where}.max_pending_checks",
            "must be an integer >= 1", options.max_pending_checks)


def encode_chunk(key: ChunkKey, payload: memoryview, secret: bytes | None = None) -> bytes:
    """The chunk's stored value: header, key, MAC with `secret`, payload. One copy of the
    payload (a BytesIO would make two: its buffer, then getvalue)."""
    return b"".join((encode_header(key, payload, secret), payload))


class RemoteTier(ThreadedTier):
    """A tier on a network key-value store. A subclass names each chunk (`_name`) and
    implements `_put`, `_get` or `_get_within` (raise MissingChunk), `_delete`, `_exists_many`
    and, where its errors tell an outage from a refusal, `_is_outage`."""

    locality: Locality = "remote"

    def __init__(self, options: Any, context: TierContext, store_kind: str) -> None:
        super().__init__(options, context)
        self._lock = threading.Lock()
        # Chunks known to be in the store, least recently used first; bounded.
        self._known: BoundedDict[ChunkKey, None] = BoundedDict(options.max_index_entries)
        # Keys an existence check found absent -> monotonic time the answer expires.
        self._absent: BoundedDict[ChunkKey, float] = BoundedDict(options.max_index_entries)
        self._checking: set[ChunkKey] = set()
        self._check_queue: queue.SimpleQueue[ChunkKey] = queue.SimpleQueue()
        self._checker = DaemonThreadPool(1, f"kvtier-{context.name}-check")
        self._checker.submit(self._check_loop)
        self._down_until = 0.0
        self._stopping = False
        self._request_seconds = self._request_errors = None
        if context.metrics is not None:
            self._request_seconds = context.metrics.histogram(
                "kvtier:offload_store_request_seconds",
                "Time of one call to a network store tier (get, put, exists, delete)",
                ["tier", "store", "op"], _REQUEST_BUCKETS)
            self._request_errors = context.metrics.counter(
                "kvtier:offload_store_request_errors",
                "Failed calls to a network store tier (connection, timeout, server error)",
                ["tier", "store", "op"])
        self._store_kind = store_kind

    # ---- lookups -----------------------------------------------------------------------------

    def lookup(self, key: ChunkKey, req_context: Any = None) -> LookupResult:
        now = time.monotonic()
        with self._lock:
            if now < self._down_until:
                return LookupResult.NOT_FOUND
            if key in self._known:
                self._known.move_to_end(key)
                return LookupResult.FOUND
            if key in self._checking:
                return LookupResult.UNKNOWN
            expires = self._absent.get(key)
            if expires is not None and expires > now:
                return LookupResult.NOT_FOUND
            if len(self._checking) >= self.options.max_pending_checks:
                return LookupResult.NOT_FOUND  # a flood of new keys: a miss beats a wait
            self._checking.add(key)
        self._check_queue.put(key)
        return LookupResult.UNKNOWN

    def _check_loop(self) -> None:
        """The probe thread: answer queued existence checks in batches until shutdown."""
        while not self._stopping:
            try:
                first = self._check_queue.get(timeout=0.1)
            except queue.Empty:
                continue
            batch = [first]
            while len(batch) < _PROBE_BATCH:
                try:
                    batch.append(self._check_queue.get_nowait())
                except queue.Empty:
                    break
            self._check(batch)

    def _check(self, keys: list[ChunkKey]) -> None:
        try:
            if time.monotonic() < self._down_until:
                raise ConnectionError("store marked down")
            found = self._call("exists", self._exists_many, [self._name(k) for k in keys])
        except Exception:  # counted by _call; a store that cannot answer misses
            found = [False] * len(keys)
        expires = time.monotonic() + _ABSENT_S
        with self._lock:
            for key, present in zip(keys, found):
                self._checking.discard(key)
                if present:
                    self._remember(key)
                else:
                    self._absent[key] = expires

    def _remember(self, key: ChunkKey) -> None:
        """Record `key` as in the store (caller holds the lock)."""
        self._known[key] = None
        self._absent.pop(key, None)

    def _forget(self, key: ChunkKey) -> None:
        with self._lock:
            self._known.pop(key, None)

    # ---- jobs (on ThreadedTier's pools) -------------------------------------------------------

    def _store(self, job: TransferJob) -> None:
        self._check_up()
        self._call("put", self._put, job.key,
                   encode_chunk(job.key, job.buffer, self.context.chunk_secret))
        with self._lock:
            self._remember(job.key)

    def _load(self, job: TransferJob) -> None:
        self._check_up()
        try:
            data = self._call("get", self._get_within, self._name(job.key), job.deadline,
                              _read_limit(job))
            read_chunk_into(io.BytesIO(data), job.key, job.buffer, self.context.chunk_secret)
        except MissingChunk:
            self._forget(job.key)
            raise
        except ChunkFormatError:
            if is_foreign_chunk(io.BytesIO(data), job.key, job.buffer, self.context.chunk_secret):
                self._mark_absent(job.key)
            else:
                self._forget(job.key)
                self._delete_quietly(job.key)  # so that the next store writes a good copy
            raise
        with self._lock:
            self._remember(job.key)

    def _mark_absent(self, key: ChunkKey) -> None:
        """Answer `key`'s lookups NOT_FOUND for a while, though the store has a value for it."""
        with self._lock:
            self._known.pop(key, None)
            self._absent[key] = time.monotonic() + _ABSENT_S

    def _check_up(self) -> None:
        if time.monotonic() < self._down_until:
            raise ConnectionError(f"{self._store_kind} store down after a failed call; retrying "
                                  f"{_DOWN_S:g} s after it")

    def _delete_quietly(self, key: ChunkKey) -> None:
        try:
            self._call("delete", self._delete, [self._name(key)])
        except Exception:
            pass  # counted by _call; the bad value stays until overwritten or evicted

    def _call(self, op: str, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`, timed; a failure other than a missing chunk is counted, and one that
        says the store cannot answer (`_is_outage`) marks it down."""
        start = time.monotonic()
        try:
            result = fn(*args)
        except MissingChunk:
            raise
        except Exception as exc:
            if self._is_outage(exc):
                self._down_until = time.monotonic() + _DOWN_S
            self._count_error(op)
            raise
        finally:
            if self._request_seconds is not None:
                self._request_seconds.labels(self.context.name, self._store_kind, op).observe(
                    time.monotonic() - start)
        return result

    def _count_error(self, op: str) -> None:
        if self._request_errors is not None:
            self._request_errors.labels(self.context.name, self._store_kind, op).inc()

    def shutdown(self) -> bool:
        self._stopping = True
        checker_stopped = self._checker.shutdown(self.options.timeout_s)
        return super().shutdown() and checker_stopped

    # ---- the store ---------------------------------------------------------------------------

    @abstractmethod
    def _name(self, key: ChunkKey) -> str:
        """The store's name for `key`'s chunk, under this tier's prefix and namespace."""

    @abstractmethod
    def _put(self, key: ChunkKey, data: bytes) -> None: ...

    def _get_within(self, name: str, deadline: float, max_bytes: int) -> bytes:
        """The value under `name`, cut after `max_bytes` bytes, for a job that must end by
        `deadline` (time.monotonic()); raises MissingChunk if there is none. By default
        `_get(name, max_bytes)`, for a client whose timeouts bound the whole read; a store whose
        reads can outlast them overrides this instead of `_get`."""
        return self._get(name, max_bytes)

    def _get(self, name: str, max_bytes: int) -> bytes:
        """The value under `name`, never more than its first `max_bytes` bytes read; raises
        MissingChunk if there is none."""
        raise NotImplementedError

    @abstractmethod
    def _delete(self, names: Sequence[str]) -> None: ...

    @abstractmethod
    def _exists_many(self, names: Sequence[str]) -> list[bool]: ...

    def _is_outage(self, exc: Exception) -> bool:
        """Whether `exc`, raised by a call to the store, says the store cannot answer now
        (connection, timeout, server error), rather than that it refused this one request. By
        default every failure does, for a store whose errors cannot be told apart."""
        return True


def _read_limit(job: TransferJob) -> int:
    """Bytes a load reads at most: one past the longest value of the job's chunk (with a MAC,
    which a tier without the secret skips), so that a longer one fails the check for trailing
    bytes without being read whole."""
    return HEADER_BYTES + len(job.key) + MAC_BYTES + len(job.buffer) + 1
