"""The secondary-tier API: four methods between the tiering manager and a storage back end
(and optional ones: `take_evicted`, for KV events; `submit_loads`, several loads in one call;
`num_mappable`, `pin_mapped` and `release_mapped`, for a tier whose chunks sit in a file mapped
into the process, loaded into the device from there).

A tier never sees device memory. Every job hands it a `memoryview` of one host slot: a store job
reads the chunk from it, a load job writes the chunk into it. Calls come from the engine thread
and must return at once; the I/O runs on the tier's own threads and its outcome is reported by
`get_finished_jobs`. A tier manages its own capacity and eviction.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from kvtier.offload.keys import ChunkKey

Locality = Literal["local", "remote"]


class LookupResult(enum.Enum):
    FOUND = "found"
    NOT_FOUND = "not_found"
    # The tier cannot tell yet (e.g. a remote query in flight); ask again next step.
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class TransferJob:
    job_id: int
    key: ChunkKey
    # The host slot: read by a store, written by a load. Exactly the chunk's bytes.
    buffer: memoryview
    # time.monotonic() value after which the manager counts the job as failed.
    deadline: float


@dataclass(frozen=True)
class JobResult:
    job_id: int
    ok: bool
    # Why it failed, for logs and error counters; None when ok.
    error: str | None = None
    # Seconds the I/O itself took, if the tier measured it (throughput metrics); None: the
    # manager uses submit-to-report time, which includes queueing.
    seconds: float | None = None
    # Why a store was not attempted (e.g. "read_only"): counted as a dropped store, not as an
    # error; None otherwise. Such a result has ok=False.
    skipped: str | None = None
    # time.monotonic() when that I/O ended, so that jobs running at the same time count their
    # shared seconds once in the busy time; None: when the manager collects the result.
    ended: float | None = None


@dataclass(frozen=True, eq=False)
class MappedChunk:
    """A chunk a tier holds in a file mapped into the process (`mapping`, a
    offload/tiers/slot_file.MappedFile), pinned there by `owner` (never overwritten) until
    `owner.release_mapped(chunk)`. A load copies its `num_bytes` bytes at `offset` of the
    mapping straight into the device, with no promotion into a host slot."""

    owner: SecondaryTier
    mapping: Any
    offset: int
    num_bytes: int
    # The owner's handle on what it pinned (the disk tier: the slot).
    pin: int


@dataclass(frozen=True)
class TierContext:
    """What a tier is told at construction."""

    # Label of this tier in metrics and events (unique among the configured tiers).
    name: str
    # Namespace digest of the KV geometry; keys already start with it, tiers may group by it.
    namespace: bytes
    # The engine's MetricsRegistry (counter/gauge/histogram) or None; tiers may register theirs.
    metrics: Any = None
    # Bytes of the largest chunk a job can carry (the host slot size); None: not known.
    max_chunk_bytes: int | None = None
    # What the namespace digest covers (model, weights digest, dtype, ...), for a tier that
    # keeps files to write beside them for operators; None: nothing to write.
    description: Mapping[str, Any] | None = None
    # The shared secret chunks written outside the process are authenticated with
    # (offload/chunk_format.py); None: checksums only.
    chunk_secret: bytes | None = field(default=None, repr=False)
    # The host tier (offload/host_cache.py), for a tier that serves its ready chunks to peers
    # (p2p); None where there is none (tests of a tier alone).
    host: Any = None
    # Called with a job's id, from any thread, once its result is ready for
    # `get_finished_jobs`, so the engine need not poll while it waits for a promotion. A tier
    # that never calls it still works: the engine then finds the result at its next step.
    on_job_end: Callable[[int], None] | None = None


class SecondaryTier(ABC):
    """A storage tier behind the host tier. Contract:

    * `lookup` answers from memory or one cheap syscall; it never waits on I/O.
    * `submit_store` / `submit_load` queue the job and return; they may raise only for a
      programming error (the manager turns any exception into a failed job).
    * every submitted job is reported exactly once by `get_finished_jobs`, `ok=False` for a
      failure of any kind (missing, corrupt, full, I/O error); a store the tier does not try
      (read-only) reports `skipped`. A load that reports
      ok=True must have written exactly the bytes that a store of the same key read.
    * the tier must not touch a job's buffer after reporting the job.
    """

    locality: Locality = "local"
    # True if the tier calls `context.on_job_end` for every job it reports.
    reports_job_ends: ClassVar[bool] = False

    def __init__(self, options: Any, context: TierContext) -> None:
        self.options = options
        self.context = context

    @abstractmethod
    def lookup(self, key: ChunkKey, req_context: Any = None) -> LookupResult: ...

    @abstractmethod
    def submit_store(self, job: TransferJob) -> None: ...

    @abstractmethod
    def submit_load(self, job: TransferJob) -> None: ...

    def submit_loads(self, jobs: Sequence[TransferJob]) -> None:
        """Queue several loads at once (a request's promotions, in the request's order); a
        tier may hand them to its threads in fewer pieces. Each job is still reported alone.
        Raises only having taken none of them (this default: when the first submit raises)."""
        for job in jobs:
            self.submit_load(job)

    @abstractmethod
    def get_finished_jobs(self) -> Iterable[JobResult]: ...

    def num_mappable(self, keys: Sequence[ChunkKey], num_bytes: int,
                     in_memory: bool = True) -> int:
        """How many of `keys`, from the first, can be loaded straight from the tier's mapped
        file now (FOUND, checked, and unless `in_memory` is False, in memory), in one pass.
        This default: none."""
        return 0

    def pin_mapped(self, chunks: Sequence[tuple[ChunkKey, int]]) -> list[MappedChunk | None]:
        """Pin each of `chunks` (key, payload bytes) in the mapped file for a load (None: it
        can no longer be)."""
        return [None] * len(chunks)

    def release_mapped(self, chunk: MappedChunk) -> None:
        """The load of a pinned chunk ended: the tier may overwrite it again."""

    def take_evicted(self) -> list[ChunkKey]:
        """Keys this tier dropped (to make room, or found damaged) since the last call, for KV
        events; a tier that does not track its evictions (a shared store others also fill)
        returns none."""
        return []

    def shutdown(self) -> None:
        """Stop the tier's threads; called once."""
