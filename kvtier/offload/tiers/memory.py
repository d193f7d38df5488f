"""The reference secondary tier: chunks kept in a dict in this process.

It is the example for tier authors (docs/tiers.md): the smallest correct implementation of the
four methods. Copies are a memcpy, so jobs finish inside `submit_*` and are reported on the next
`get_finished_jobs`; a real tier would hand them to its own threads.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from kvtier.common.options import require
from kvtier.common.sizes import parse_size
from kvtier.offload.keys import ChunkKey
from kvtier.offload.tiers.base import (
    JobResult,
    LookupResult,
    SecondaryTier,
    TierContext,
    TransferJob,
)


@dataclass(frozen=True)
class MemoryTierOptions:
    # Byte budget; the least recently used chunks are dropped beyond it. None: unbounded.
    max_bytes: int | str | None = None

    def __post_init__(self) -> None:
        if self.max_bytes is not None:
            object.__setattr__(self, "max_bytes", parse_size(self.max_bytes, "memory.max_bytes"))
            require(self.max_bytes > 0, "memory.max_bytes", "must be > 0", self.max_bytes)


class MemoryTier(SecondaryTier):
    options_cls: ClassVar[type] = MemoryTierOptions

    def __init__(self, options: MemoryTierOptions, context: TierContext) -> None:
        super().__init__(options, context)
        self._chunks: OrderedDict[ChunkKey, bytes] = OrderedDict()  # least recently used first
        self._num_bytes = 0
        self._finished: list[JobResult] = []

    def lookup(self, key: ChunkKey, req_context: Any = None) -> LookupResult:
        return LookupResult.FOUND if key in self._chunks else LookupResult.NOT_FOUND

    def submit_store(self, job: TransferJob) -> None:
        if job.key not in self._chunks:
            self._chunks[job.key] = bytes(job.buffer)
            self._num_bytes += len(job.buffer)
            self._evict_over_budget()
        self._finished.append(JobResult(job.job_id, ok=True))

    def submit_load(self, job: TransferJob) -> None:
        data = self._chunks.get(job.key)
        if data is None or len(data) != len(job.buffer) or time.monotonic() > job.deadline:
            self._finished.append(JobResult(job.job_id, ok=False, error="missing or late"))
            return
        job.buffer[:] = data
        self._chunks.move_to_end(job.key)
        self._finished.append(JobResult(job.job_id, ok=True))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        finished, self._finished = self._finished, []
        return finished

    def _evict_over_budget(self) -> None:
        budget = self.options.max_bytes
        while budget is not None and self._num_bytes > budget and self._chunks:
            _, data = self._chunks.popitem(last=False)
            self._num_bytes -= len(data)
