"""What the offloading halves tell each other each step (plain data): the scheduler half's
metadata (which chunks to copy) and the worker half's report (which copies finished)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.connector.base import KVConnectorMetadata, KVConnectorReport
from kvtier.offload.tiers.base import MappedChunk

# "device_to_host", "host_to_device", or "<tier>_to_device": loads straight from a tier's
# mapped file (MappedChunk).
Direction = str


@dataclass(frozen=True)
class ChunkTransfer:
    """Copy some blocks of one chunk of one KV cache group between a host slot and the device.

    `block_offsets[i]` is the block's place inside the chunk, `block_ids[i]` the device block.
    A load comes from host slot `slot`, or, with `mapped`, straight from a tier's mapped file.
    A load with neither has lost its chunk since the lookup: its blocks are reported as load
    errors, so the scheduler recomputes them.
    """

    job_id: int
    req_id: str
    group_id: int
    slot: int | None
    block_offsets: tuple[int, ...]
    block_ids: tuple[int, ...]
    mapped: MappedChunk | None = None


@dataclass
class OffloadingConnectorMetadata(KVConnectorMetadata):
    # host -> device, started in start_load_kv; reported per request in finished_recving.
    loads: list[ChunkTransfer] = field(default_factory=list)
    # device -> host, started in wait_for_save once this step's KV is written.
    stores: list[ChunkTransfer] = field(default_factory=list)


@dataclass(frozen=True)
class BatchDone:
    """The worker finished one batch of copies in `direction`. `job_ids` are the transfers it
    completes; `ok` False means none of them moved valid data."""

    direction: Direction
    job_ids: tuple[int, ...]
    ok: bool
    num_bytes: int
    seconds: float
    # time.monotonic() when the batch ended (busy-time metrics)
    ended: float


@dataclass
class OffloadingConnectorReport(KVConnectorReport):
    # The copy batches that ended since the last report, in the order they ended.
    batches: list[BatchDone] = field(default_factory=list)
