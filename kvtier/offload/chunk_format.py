"""The checked format of every chunk of KV that leaves the process, and the namespace
description files written beside such chunks.

One chunk (an fs tier file, a disk tier slot, an ExampleConnector block file):

    header (36 bytes, little endian): magic b"KVTC", format version u16, flags u16 (0),
        key length u32, payload length u64, xxh3-128 of the payload (16 bytes)
    key     (key length bytes): the full key, so a chunk is never taken for another key
    payload (payload length bytes): the KV bytes

A chunk whose magic, version, key, length or checksum does not match is a miss, never data.
Nothing here unpickles: another process (or user) may have written the bytes.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

import xxhash

logger = logging.getLogger(__name__)

MAGIC = b"KVTC"
FORMAT_VERSION = 1
# Names the format in namespace descriptions.
FORMAT_NAME = f"{MAGIC.decode()}/{FORMAT_VERSION}"
_HEADER = struct.Struct("<4sHHIQ16s")
HEADER_BYTES = _HEADER.size


class ChunkFormatError(Exception):
    """Bytes that are not a valid copy of the chunk asked for."""


@dataclass(frozen=True)
class ChunkHeader:
    key_bytes: int
    payload_bytes: int
    checksum: bytes


def encode_header(key: bytes, payload: memoryview) -> bytes:
    """The header and key that precede `payload`."""
    checksum = xxhash.xxh3_128(payload).digest()
    return _HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(key), len(payload), checksum) + key


def decode_header(data: bytes | bytearray | memoryview) -> ChunkHeader:
    """The fixed header at the start of `data`; raises for anything but this format."""
    if len(data) < HEADER_BYTES:
        raise ChunkFormatError("truncated header")
    magic, version, _flags, key_bytes, payload_bytes, checksum = _HEADER.unpack_from(data)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise ChunkFormatError(f"bad magic/version {magic!r}/{version}")
    return ChunkHeader(key_bytes, payload_bytes, checksum)


def check_header(header: ChunkHeader, stored_key: bytes | None, key: bytes,
                 payload_bytes: int) -> None:
    """Raise unless the chunk is `key`'s with a `payload_bytes` payload."""
    if header.key_bytes != len(key) or stored_key != key:
        raise ChunkFormatError("key mismatch")
    if header.payload_bytes != payload_bytes:
        raise ChunkFormatError(f"payload is {header.payload_bytes} bytes, expected "
                               f"{payload_bytes}")


def check_payload(header: ChunkHeader, payload: memoryview) -> None:
    if xxhash.xxh3_128(payload).digest() != header.checksum:
        raise ChunkFormatError("checksum mismatch")


def file_size(key: bytes, payload_bytes: int) -> int:
    return HEADER_BYTES + len(key) + payload_bytes


def write_chunk(f: BinaryIO, key: bytes, payload: memoryview) -> None:
    f.write(encode_header(key, payload))
    f.write(payload)


def read_chunk_into(f: BinaryIO, key: bytes, out: memoryview) -> None:
    """Fill `out` with the chunk's payload, or raise ChunkFormatError (then `out` is garbage)."""
    header = decode_header(f.read(HEADER_BYTES))
    # Never read a key length taken from the file: it may be anything.
    stored_key = f.read(len(key)) if header.key_bytes == len(key) else None
    check_header(header, stored_key, key, len(out))
    num_read = 0
    while num_read < len(out):
        n = f.readinto(out[num_read:])
        if not n:
            raise ChunkFormatError(f"truncated payload ({num_read} of {len(out)} bytes)")
        num_read += n
    if f.read(1):
        raise ChunkFormatError("trailing bytes after the payload")
    check_payload(header, out)


def drop_bad_file(f: BinaryIO, path: str) -> None:
    """Delete `path`, which failed its check, so that a later store writes a good copy; only if
    it is still the file `f` read (another process may have replaced it meanwhile)."""
    try:
        if os.path.samestat(os.fstat(f.fileno()), os.stat(path)):
            os.unlink(path)
    except OSError:
        pass  # gone already


def write_description(directory: str, namespace: bytes, description: Mapping[str, Any]) -> None:
    """Write `<directory>/<namespace hex>.json` once (temp file + rename), for operators: it says
    what the namespace covers, so they can see why two instances do not share. Nothing reads it
    back; a failure to write it is logged, never raised."""
    path = os.path.join(directory, namespace.hex() + ".json")
    if os.path.exists(path):
        return
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        os.makedirs(directory, exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(dict(description), f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except OSError as exc:
        logger.warning("cannot write the namespace description %s: %s", path, exc)
        try:
            os.unlink(tmp)
        except OSError:
            pass
