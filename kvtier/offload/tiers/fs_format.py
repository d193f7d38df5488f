"""The on-disk format of one chunk file of the fs tier.

    header (36 bytes, little endian): magic b"KVTC", format version u16, flags u16 (0),
        key length u32, payload length u64, xxh3-128 of the payload (16 bytes)
    key     (key length bytes): the full chunk key, so a file is never taken for another key
    payload (payload length bytes): the chunk in the standard host layout

A file whose magic, version, key, length or checksum does not match is a miss, never data.
"""

from __future__ import annotations

import struct
from typing import BinaryIO

import xxhash

from kvtier.offload.keys import ChunkKey

MAGIC = b"KVTC"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sHHIQ16s")


class ChunkFileError(Exception):
    """A chunk file is not a valid copy of the chunk asked for."""


def file_size(key: ChunkKey, payload_bytes: int) -> int:
    return _HEADER.size + len(key) + payload_bytes


def write_chunk(f: BinaryIO, key: ChunkKey, payload: memoryview) -> None:
    checksum = xxhash.xxh3_128(payload).digest()
    f.write(_HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(key), len(payload), checksum))
    f.write(key)
    f.write(payload)


def read_chunk_into(f: BinaryIO, key: ChunkKey, out: memoryview) -> None:
    """Fill `out` with the chunk's payload, or raise ChunkFileError (then `out` is garbage)."""
    header = f.read(_HEADER.size)
    if len(header) != _HEADER.size:
        raise ChunkFileError("truncated header")
    magic, version, _flags, key_len, payload_len, checksum = _HEADER.unpack(header)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise ChunkFileError(f"bad magic/version {magic!r}/{version}")
    if key_len != len(key) or f.read(key_len) != key:
        raise ChunkFileError("key mismatch")
    if payload_len != len(out):
        raise ChunkFileError(f"payload is {payload_len} bytes, expected {len(out)}")
    num_read = 0
    while num_read < len(out):
        n = f.readinto(out[num_read:])
        if not n:
            raise ChunkFileError(f"truncated payload ({num_read} of {len(out)} bytes)")
        num_read += n
    if f.read(1):
        raise ChunkFileError("trailing bytes after the payload")
    if xxhash.xxh3_128(out).digest() != checksum:
        raise ChunkFileError("checksum mismatch")
