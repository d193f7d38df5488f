"""Chunk keys: the identity of one chunk of KV outside the process.

key = namespace digest + group id + hash of the chunk's last block. Block hashes are chained
(each covers its whole prefix), so the last block's hash names every token before it; the
namespace keeps instances with incompatible chunks apart: other weights, dtype, block size,
layout or KV spec kinds (the engine's KVIdentity), other blocks_per_chunk or chunk format (added
here).
"""

from __future__ import annotations

import hashlib
from typing import NewType

from kvtier.kv import KVIdentity
from kvtier.offload.chunk_format import FORMAT_NAME

ChunkKey = NewType("ChunkKey", bytes)

_GROUP_ID_BYTES = 2


def chunk_identity(identity: KVIdentity, blocks_per_chunk: int) -> KVIdentity:
    """The identity of chunks of `blocks_per_chunk` blocks: its `namespace` prefixes their keys.
    The same block hash ends chunks of different sizes, so the size must be in the namespace."""
    return identity.extended(blocks_per_chunk=blocks_per_chunk, chunk_format=FORMAT_NAME)


def make_chunk_key(namespace: bytes, group_id: int, last_block_hash: bytes) -> ChunkKey:
    if not 0 <= group_id < 2 ** (8 * _GROUP_ID_BYTES):
        raise ValueError(f"group_id must be in [0, 65536), got {group_id}")
    return ChunkKey(namespace + group_id.to_bytes(_GROUP_ID_BYTES, "big") + last_block_hash)


def key_digest(key: ChunkKey) -> str:
    """A fixed-length hex name for `key` (file names, object names, log lines)."""
    return hashlib.sha256(key).hexdigest()
