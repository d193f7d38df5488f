"""The checked chunk format shared by the fs tier, the disk tier and ExampleConnector: every way
a chunk can be wrong is refused, and namespace descriptions are written once."""

import io
import json
import logging
import os
import struct

import pytest

from kvtier.offload.chunk_format import (
    HEADER_BYTES,
    ChunkFormatError,
    read_chunk_into,
    write_chunk,
    write_description,
)

KEY = b"namespace-and-block-hash"
PAYLOAD = bytes(range(256)) * 4


def _chunk(key=KEY, payload=PAYLOAD):
    f = io.BytesIO()
    write_chunk(f, key, memoryview(payload))
    return f.getvalue()


def _read(data, key=KEY, size=None):
    out = bytearray(len(PAYLOAD) if size is None else size)
    read_chunk_into(io.BytesIO(data), key, memoryview(out))
    return bytes(out)


def test_round_trip():
    data = _chunk()
    assert len(data) == HEADER_BYTES + len(KEY) + len(PAYLOAD)
    assert data[:4] == b"KVTC"
    assert _read(data) == PAYLOAD


def _with_key_length(data, key_length):
    return data[:8] + struct.pack("<I", key_length) + data[12:]


@pytest.mark.parametrize("damage, message", [
    (lambda d: d[:HEADER_BYTES - 1], "truncated header"),
    (lambda d: b"XXXX" + d[4:], "bad magic/version"),
    (lambda d: d[:4] + b"\x02\x00" + d[6:], "bad magic/version"),
    (lambda d: _with_key_length(d, 2**32 - 1), "key mismatch"),
    (lambda d: d[:HEADER_BYTES] + b"N" + d[HEADER_BYTES + 1:], "key mismatch"),
    (lambda d: d[:-1], "truncated payload"),
    (lambda d: d + b"\0", "trailing bytes"),
    (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "checksum mismatch"),
])
def test_a_damaged_chunk_is_refused(damage, message):
    with pytest.raises(ChunkFormatError, match=message):
        _read(damage(_chunk()))


def test_another_key_or_size_is_refused():
    with pytest.raises(ChunkFormatError, match="key mismatch"):
        _read(_chunk(key=b"another key of the same size!!"[:len(KEY)]))
    with pytest.raises(ChunkFormatError, match="payload is 1024 bytes, expected 512"):
        _read(_chunk(), size=512)


def test_a_description_is_written_once_and_atomically(tmp_path):
    namespace = bytes(range(32))
    write_description(str(tmp_path / "ns"), namespace, {"blocks_per_chunk": 1})
    write_description(str(tmp_path / "ns"), namespace, {"blocks_per_chunk": 2})
    assert os.listdir(tmp_path / "ns") == [namespace.hex() + ".json"]  # no temp file left
    with open(tmp_path / "ns" / (namespace.hex() + ".json")) as f:
        assert json.load(f) == {"blocks_per_chunk": 1}


def test_a_description_that_cannot_be_written_only_logs(tmp_path, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="kvtier.offload.chunk_format"):
        write_description(str(blocked / "ns"), bytes(32), {"model": "m"})
    assert "cannot write the namespace description" in caplog.text
