"""The KV event wire schema: vLLM's (0.32), plus where each copy lives.

  PUB multipart message: [topic bytes, seq (8-byte big-endian), msgpack payload]
  payload = [ts, [event, ...], data_parallel_rank]
  event   = {"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids",
             "block_size", "lora_id", "medium", "lora_name", and when set "group_idx",
             "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality", "ownership"}
          | {"type": "BlockRemoved", "block_hashes", "medium", and when set "group_idx",
             "locality", "ownership"}
          | {"type": "AllBlocksCleared"}

Events are maps tagged with their type, as vLLM's msgspec structs encode them (fields left at
their default are left out); the batch is an array. Every event names blocks by the same 64-bit
block hashes (the low 64 bits of the engine's chained hash), whatever holds them: `medium` is
"GPU" for the device's paged cache, "CPU" for host memory and "STORAGE" for a secondary tier,
whose name is the `ownership`; `locality` is "LOCAL" (this instance's own memory or disk) or
"REMOTE" (a store other instances read too). AllBlocksCleared clears the device cache only.
The decoder also reads the older array-encoded events of vLLM (before 0.32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import msgpack

BlockHash64 = int
# Internal spelling; the wire's is upper case (vLLM's LOCAL / REMOTE).
Locality = Literal["local", "remote"]

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
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
    # The KV cache group, its kind ("full_attention", "sliding_window", "mamba") and window.
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: Locality = "local"
    # The secondary tier's name, for a copy in one.
    ownership: str | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """The copies of these blocks in `medium` are gone (other media may still hold them)."""

    block_hashes: list[BlockHash64]
    medium: str
    group_idx: int | None = None
    locality: Locality = "local"
    ownership: str | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every block of the device cache was dropped (a prefix cache reset)."""


WireEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class EventBatch:
    ts: float
    events: list[WireEvent]
    data_parallel_rank: int = 0


# Fields every event of a type carries (null or not); the others only when set.
_ALWAYS = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                           "lora_id", "medium", "lora_name"),
           "BlockRemoved": ("block_hashes", "medium"),
           "AllBlocksCleared": ()}
_WHEN_SET = {"BlockStored": ("group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
                             "locality", "ownership"),
             "BlockRemoved": ("group_idx", "locality", "ownership"),
             "AllBlocksCleared": ()}
_TYPES = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved,
          "AllBlocksCleared": AllBlocksCleared}
# The wire type of each of those fields when it is not null (an int never a bool or a float).
_FIELD_TYPES: dict[str, type] = {
    "block_hashes": list, "parent_block_hash": int, "token_ids": list, "block_size": int,
    "lora_id": int, "medium": str, "lora_name": str, "group_idx": int,
    "kv_cache_spec_kind": str, "kv_cache_spec_sliding_window": int, "locality": str,
    "ownership": str}


def external_block_hash(block_hash: bytes | int | None) -> BlockHash64 | None:
    """The low 64 bits of a block hash as an int (vLLM's default external form)."""
    if block_hash is None or isinstance(block_hash, int):
        return block_hash
    return int.from_bytes(block_hash[-8:], "big") & _HASH_MASK


def encode_event(event: WireEvent) -> dict[str, Any]:
    """One event as the tagged map vLLM's consumers decode."""
    name = type(event).__name__
    if name not in _TYPES or not isinstance(event, _TYPES[name]):
        raise TypeError(f"not a wire event: {name}")
    encoded: dict[str, Any] = {"type": name}
    for field in _ALWAYS[name]:
        value = getattr(event, field)
        encoded[field] = list(value) if isinstance(value, list) else value
    for field in _WHEN_SET[name]:
        value = getattr(event, field)
        if field == "locality":
            value = value.upper()
        if value is not None:
            encoded[field] = value
    return encoded


def encode_batch(batch: EventBatch) -> bytes:
    return msgpack.packb([batch.ts, [encode_event(e) for e in batch.events],
                          batch.data_parallel_rank], use_bin_type=True)


def decode_batch(payload: bytes) -> EventBatch:
    """The batch in `payload`; event types this schema does not know are skipped, so a newer
    publisher's additions do not break an older subscriber. Anything else that is not this
    schema raises EventDecodeError, never another exception: a subscriber skips the batch and
    goes on."""
    try:
        return _decode_batch(msgpack.unpackb(payload, raw=False, strict_map_key=True))
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise EventDecodeError(f"not a KV event batch: {exc!r}") from exc


def _decode_batch(batch: Any) -> EventBatch:
    if not isinstance(batch, list) or len(batch) < 2:
        raise ValueError("a batch is an array [ts, events, data_parallel_rank]")
    ts, raw_events, *rest = batch
    rank = rest[0] if rest and rest[0] is not None else 0
    # type() rather than isinstance(): a bool is no number here.
    if type(ts) not in (int, float) or not math.isfinite(ts):
        raise ValueError(f"ts must be a finite number, got {ts!r:.80}")
    if type(rank) is not int:
        raise ValueError(f"data_parallel_rank must be an integer, got {rank!r:.80}")
    if not isinstance(raw_events, list):
        raise ValueError(f"events must be an array, got {raw_events!r:.80}")
    events = [event for event in map(_decode_event, raw_events) if event is not None]
    return EventBatch(float(ts), events, rank)


def _decode_event(raw: Any) -> WireEvent | None:
    if isinstance(raw, list) and raw:
        fields = _array_fields(raw)
    elif isinstance(raw, dict):
        fields = raw
    else:
        raise ValueError(f"an event is a map or an array, got {raw!r:.80}")
    name = fields.get("type")
    if not isinstance(name, str) or name not in _TYPES:
        return None
    if name == "AllBlocksCleared":
        return AllBlocksCleared()
    known = {k: fields[k] for k in _ALWAYS[name] + _WHEN_SET[name]
             if fields.get(k) is not None}
    for field, value in known.items():
        if type(value) is not _FIELD_TYPES[field]:
            raise ValueError(f"{name}.{field} must be of type {_FIELD_TYPES[field].__name__}, "
                             f"got {value!r:.80}")
    for field in ("block_hashes", "token_ids"):
        if not all(type(v) is int for v in known.get(field, ())):
            raise ValueError(f"{name}.{field} must be integers")
    if "locality" in known:
        known["locality"] = _locality(known["locality"])
    known.setdefault("medium", MEDIUM_GPU)  # unspecified: the device cache's, as vLLM's were
    if name == "BlockStored":
        known.setdefault("parent_block_hash", None)
        known.setdefault("token_ids", [])
        known.setdefault("lora_id", None)
    return _TYPES[name](**known)


def _array_fields(raw: list[Any]) -> dict[str, Any]:
    """An array-encoded event (vLLM before 0.32): its tag, then the fields every event of its
    type carries, in order; the optional ones after them are left out (their order changed
    between versions)."""
    name = raw[0]
    return {"type": name, **dict(zip(_ALWAYS.get(name, ()), raw[1:]))}


def _locality(value: str) -> Locality:
    if value.lower() not in ("local", "remote"):
        raise ValueError(f"locality must be 'LOCAL' or 'REMOTE', got {value!r}")
    return value.lower()  # type: ignore[return-value]
