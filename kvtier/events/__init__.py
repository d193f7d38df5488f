"""KV cache events on the wire: the schema the engine publishes and the router reads (no torch)."""

from kvtier.events.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventDecodeError,
    WireEvent,
    decode_batch,
    encode_batch,
    encode_event,
    external_block_hash,
)

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "EventBatch", "EventDecodeError",
           "WireEvent", "decode_batch", "encode_batch", "encode_event", "external_block_hash"]
