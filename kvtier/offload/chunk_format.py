"""The checked format of every chunk of KV that leaves the process, and the namespace
description files written beside such chunks.

One chunk (an fs tier file, a disk tier slot, an ExampleConnector block file):

    header (36 bytes, little endian): magic b"KVTC", format version u16, flags u16,
        key length u32, payload length u64, xxh3-128 of the payload (16 bytes)
    key     (key length bytes): the full key, so a chunk is never taken for another key
    MAC     (32 bytes, only with flag 1): HMAC-SHA256 of header, key and payload
    payload (payload length bytes): the KV bytes

A chunk whose magic, version, key, length or checksum does not match is a miss, never data.
The checksum catches damage, not tampering: anyone who can write a shared tier can write a chunk
with a matching checksum. With a shared secret (`load_chunk_secret`) every chunk is written with
a MAC and a chunk without a valid one is a miss too. Nothing here unpickles: another process (or
user) may have written the bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

import xxhash

from kvtier.offload.safe_dir import is_regular_file, opened_dir, write_atomically

logger = logging.getLogger(__name__)

MAGIC = b"KVTC"
FORMAT_VERSION = 1
# Names the format in namespace descriptions.
FORMAT_NAME = f"{MAGIC.decode()}/{FORMAT_VERSION}"
_HEADER = struct.Struct("<4sHHIQ16s")
HEADER_BYTES = _HEADER.size
FLAG_MAC = 1
MAC_BYTES = hashlib.sha256().digest_size
# Where the shared secret comes from when the config names no file (a file path, or the secret).
SECRET_FILE_ENV = "KVTIER_CHUNK_SECRET_FILE"
SECRET_ENV = "KVTIER_CHUNK_SECRET"
MIN_SECRET_BYTES = 16


class ChunkFormatError(Exception):
    """Bytes that are not a valid copy of the chunk asked for."""


class ChunkSecretError(ValueError):
    """The configured chunk secret cannot be read or is too short (the message says which)."""


@dataclass(frozen=True)
class ChunkHeader:
    flags: int
    key_bytes: int
    payload_bytes: int
    checksum: bytes

    @property
    def mac_bytes(self) -> int:
        return MAC_BYTES if self.flags & FLAG_MAC else 0


def load_chunk_secret(secret_file: str | None = None) -> bytes | None:
    """The secret chunks are authenticated with: the file `secret_file`, else the file named by
    $KVTIER_CHUNK_SECRET_FILE, else $KVTIER_CHUNK_SECRET; None when none is set. Never a
    command-line value: those show in `ps`. A trailing newline of a file is not part of it."""
    source = secret_file or os.environ.get(SECRET_FILE_ENV)
    if source:
        try:
            with open(source, "rb") as f:
                secret = f.read().rstrip(b"\r\n")
        except OSError as exc:
            raise ChunkSecretError(f"cannot read the chunk secret file {source}: "
                                   f"{exc.strerror}; fix the path or its permissions") from exc
    elif os.environ.get(SECRET_ENV):
        source, secret = f"${SECRET_ENV}", os.environ[SECRET_ENV].encode()
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise ChunkSecretError(f"the chunk secret from {source} has {len(secret)} bytes; use at "
                               f"least {MIN_SECRET_BYTES} random bytes")
    return secret


def encode_header(key: bytes, payload: memoryview, secret: bytes | None = None) -> bytes:
    """The header, key and (with `secret`) MAC that precede `payload`."""
    checksum = xxhash.xxh3_128(payload).digest()
    flags = 0 if secret is None else FLAG_MAC
    head = _HEADER.pack(MAGIC, FORMAT_VERSION, flags, len(key), len(payload), checksum) + key
    return head if secret is None else head + _mac(secret, head, payload)


def decode_header(data: bytes | bytearray | memoryview) -> ChunkHeader:
    """The fixed header at the start of `data`; raises for anything but this format."""
    if len(data) < HEADER_BYTES:
        raise ChunkFormatError("truncated header")
    magic, version, flags, key_bytes, payload_bytes, checksum = _HEADER.unpack_from(data)
    if magic != MAGIC or version != FORMAT_VERSION or flags & ~FLAG_MAC:
        raise ChunkFormatError(f"bad magic/version/flags {magic!r}/{version}/{flags}")
    return ChunkHeader(flags, key_bytes, payload_bytes, checksum)


def check_header(header: ChunkHeader, stored_key: bytes | None, key: bytes,
                 payload_bytes: int, secret: bytes | None = None) -> None:
    """Raise unless the chunk is `key`'s with a `payload_bytes` payload (and, with `secret`,
    carries a MAC)."""
    if header.key_bytes != len(key) or stored_key != key:
        raise ChunkFormatError("key mismatch")
    if header.payload_bytes != payload_bytes:
        raise ChunkFormatError(f"payload is {header.payload_bytes} bytes, expected "
                               f"{payload_bytes}")
    if secret is not None and not header.mac_bytes:
        raise ChunkFormatError("no MAC: written without the chunk secret")


def check_payload(header: ChunkHeader, payload: memoryview, secret: bytes | None = None,
                  head: bytes = b"", mac: bytes = b"") -> None:
    """Raise unless `payload` matches the checksum and, with `secret`, `mac` is the MAC of
    `head` (header and key, as stored) and `payload`."""
    if xxhash.xxh3_128(payload).digest() != header.checksum:
        raise ChunkFormatError("checksum mismatch")
    if secret is not None and not hmac.compare_digest(_mac(secret, head, payload), mac):
        raise ChunkFormatError("MAC mismatch: written with another secret, or forged")


def _mac(secret: bytes, head: bytes, payload: memoryview) -> bytes:
    mac = hmac.new(secret, head, hashlib.sha256)
    mac.update(payload)
    return mac.digest()


def file_size(key: bytes, payload_bytes: int, secret: bytes | None = None) -> int:
    return HEADER_BYTES + len(key) + (0 if secret is None else MAC_BYTES) + payload_bytes


def write_chunk(f: BinaryIO, key: bytes, payload: memoryview,
                secret: bytes | None = None) -> None:
    f.write(encode_header(key, payload, secret))
    f.write(payload)


def read_chunk_into(f: BinaryIO, key: bytes, out: memoryview,
                    secret: bytes | None = None) -> None:
    """Fill `out` with the chunk's payload, or raise ChunkFormatError (then `out` is garbage).
    Without `secret` a MAC, if any, is skipped: nothing could check it."""
    raw = f.read(HEADER_BYTES)
    header = decode_header(raw)
    # Never read a key length taken from the file: it may be anything.
    stored_key = f.read(len(key)) if header.key_bytes == len(key) else None
    check_header(header, stored_key, key, len(out), secret)
    mac = f.read(header.mac_bytes)
    num_read = 0
    while num_read < len(out):
        n = f.readinto(out[num_read:])
        if not n:
            raise ChunkFormatError(f"truncated payload ({num_read} of {len(out)} bytes)")
        num_read += n
    if f.read(1):
        raise ChunkFormatError("trailing bytes after the payload")
    check_payload(header, out, secret, raw + key, mac)


def is_foreign_chunk(f: BinaryIO, key: bytes, out: memoryview, secret: bytes | None) -> bool:
    """Whether the chunk in `f` from where it stands, which failed its checks under `secret`, is
    an intact copy of `key`'s chunk that only lacks a MAC made with `secret` (written with
    another secret, or none): a miss to keep, as a misconfigured instance must not wipe a pool
    others share, not damage to delete. Checked without the secret, into `out` (garbage after a
    failed read anyway)."""
    if secret is None:
        return False
    try:
        read_chunk_into(f, key, out)
    except ChunkFormatError:
        return False
    return True


def drop_bad_file(f: BinaryIO, name: str, dir_fd: int) -> None:
    """Delete `name` in `dir_fd`, which failed its check, so that a later store writes a good
    copy; only if it is still the file `f` read (another process may have replaced it)."""
    try:
        if os.path.samestat(os.fstat(f.fileno()),
                            os.stat(name, dir_fd=dir_fd, follow_symlinks=False)):
            os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass  # gone already


def write_description(directory: str, namespace: bytes, description: Mapping[str, Any]) -> None:
    """Write `<directory>/<namespace hex>.json` once (temp file + rename), for operators: it says
    what the namespace covers, so they can see why two instances do not share. Nothing reads it
    back; a failure to write it (a read-only or symlinked directory included) is logged, never
    raised."""
    name = namespace.hex() + ".json"
    data = json.dumps(dict(description), indent=2).encode() + b"\n"
    try:
        os.makedirs(directory, 0o700, exist_ok=True)
        with opened_dir(directory) as dir_fd:
            if not is_regular_file(name, dir_fd):
                write_atomically(name, dir_fd, lambda f: f.write(data))
    except OSError as exc:
        logger.warning("cannot write the namespace description %s: %s",
                       os.path.join(directory, name), exc)
