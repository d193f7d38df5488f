"""vLLM 0.32's KV event wire schema as msgspec structs, as its consumers (vLLM's own
subscriber, llm-d, Dynamo) decode the events: a batch array of events that are maps tagged
"type", strict about types. Decoding kvtier's payloads with these shows they are readable as
vLLM's (written from vLLM's field list; only what the wire carries)."""

from __future__ import annotations

from typing import Any

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


def decode(payload: bytes) -> EventBatch:
    return msgspec.msgpack.decode(payload, type=EventBatch)


def encode(batch: EventBatch) -> bytes:
    return msgspec.msgpack.encode(batch)
