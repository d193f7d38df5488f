"""The KV event wire schema: vLLM's layout, plus where each copy lives.

  PUB multipart message: [topic bytes, seq (8-byte big-endian), msgpack payload]
  payload = [ts, [event, ...], data_parallel_rank]
  event   = ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
             medium, lora_name, locality]
          | ["BlockRemoved", block_hashes, medium, locality]
          | ["AllBlocksCleared"]

Every event names blocks by the same 64-bit block hashes (the low 64 bits of the engine's
chained hash), whatever holds them: `medium` is "GPU" for the device's paged cache, "CPU" for
host memory, "DISK" for a local disk or file tier, and a remote tier's name otherwise.
`locality` is "local" (this instance's own memory or disk) or "remote" (a store other instances
read too). Both come after vLLM's own fields, so vLLM's decoders, which ignore trailing fields,
read the rest unchanged. AllBlocksCleared clears the device cache only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import msgpack

BlockHash64 = int
Locality = Literal["local", "remote"]

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"
_HASH_MASK = (1 << 64) - 1


class EventDecodeError(ValueError):
    """A payload that is not an event batch in this schema; the message says what is wrong."""


@dataclass(frozen=True)
class BlockStored:
    """Consecutive blocks now have a copy in `medium`, chained after `parent_block_hash` (None:
    the first is block 0, or not known for a copy between tiers)."""

    block_hashes: list[BlockHash64]
    parent_block_hash: BlockHash64 | None
    # Empty when the publisher leaves prompts out, and for copies between tiers.
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str
    lora_name: str | None = None
    locality: Locality = "local"


@dataclass(frozen=True)
class BlockRemoved:
    """The copies of these blocks in `medium` are gone (other media may still hold them)."""

    block_hashes: list[BlockHash64]
    medium: str
    locality: Locality = "local"


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every block of the device cache was dropped (a prefix cache reset)."""


WireEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class EventBatch:
    ts: float
    events: list[WireEvent]
    data_parallel_rank: int = 0


def external_block_hash(block_hash: bytes | int | None) -> BlockHash64 | None:
    """The low 64 bits of a block hash as an int (vLLM's default external form)."""
    if block_hash is None or isinstance(block_hash, int):
        return block_hash
    return int.from_bytes(block_hash[-8:], "big") & _HASH_MASK


def encode_event(event: WireEvent) -> list[Any]:
    """One event as the tagged array consumers decode."""
    if isinstance(event, BlockStored):
        return ["BlockStored", list(event.block_hashes), event.parent_block_hash,
                list(event.token_ids), event.block_size, event.lora_id, event.medium,
                event.lora_name, event.locality]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", list(event.block_hashes), event.medium, event.locality]
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a wire event: {type(event).__name__}")


def encode_batch(batch: EventBatch) -> bytes:
    return msgpack.packb([batch.ts, [encode_event(e) for e in batch.events],
                          batch.data_parallel_rank], use_bin_type=True)


def decode_batch(payload: bytes) -> EventBatch:
    """The batch in `payload`; event types this schema does not know are skipped, so a newer
    publisher's additions do not break an older subscriber."""
    try:
        ts, raw_events, rank = msgpack.unpackb(payload, raw=False, strict_map_key=True)
        events = [event for event in map(_decode_event, raw_events) if event is not None]
    except (ValueError, TypeError, IndexError, msgpack.UnpackException) as exc:
        raise EventDecodeError(f"not a KV event batch: {exc}") from exc
    return EventBatch(float(ts), events, int(rank))


def _decode_event(raw: list[Any]) -> WireEvent | None:
    name = raw[0]
    if name == "BlockStored":
        hashes, parent, token_ids, block_size, lora_id, medium = raw[1:7]
        lora_name = raw[7] if len(raw) > 7 else None
        locality = raw[8] if len(raw) > 8 else "local"
        return BlockStored(_hashes(hashes), parent, list(token_ids), int(block_size), lora_id,
                           str(medium), lora_name, _locality(locality))
    if name == "BlockRemoved":
        locality = raw[3] if len(raw) > 3 else "local"
        return BlockRemoved(_hashes(raw[1]), str(raw[2]), _locality(locality))
    if name == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def _hashes(values: list[Any]) -> list[BlockHash64]:
    if not all(isinstance(v, int) for v in values):
        raise ValueError("block hashes must be integers")
    return list(values)


def _locality(value: Any) -> Locality:
    if value not in ("local", "remote"):
        raise ValueError(f"locality must be 'local' or 'remote', got {value!r}")
    return value
