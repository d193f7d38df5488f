"""What the offloading scheduler half tells its worker half each step (plain data)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.connector.base import KVConnectorMetadata


@dataclass(frozen=True)
class ChunkTransfer:
    """Copy some blocks of one chunk of one KV cache group between a host slot and the device.

    `block_offsets[i]` is the block's place inside the chunk, `block_ids[i]` the device block.
    A load whose `slot` is None has lost its chunk since the lookup: its blocks are reported as
    load errors, so the scheduler recomputes them.
    """

    job_id: int
    req_id: str
    group_id: int
    slot: int | None
    block_offsets: tuple[int, ...]
    block_ids: tuple[int, ...]


@dataclass
class OffloadingConnectorMetadata(KVConnectorMetadata):
    # Names the in-process session (host area + completion queue) both halves share.
    session_id: str
    # host -> device, started in start_load_kv; reported per request in finished_recving.
    loads: list[ChunkTransfer] = field(default_factory=list)
    # device -> host, started in wait_for_save once this step's KV is written.
    stores: list[ChunkTransfer] = field(default_factory=list)
