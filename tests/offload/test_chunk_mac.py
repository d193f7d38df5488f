"""Chunks authenticated with a shared secret: with one configured, a chunk that is not signed
with it (forged with a recomputed checksum, signed with another secret, or not signed) is a miss
and a counted error, in the chunk format and in both file tiers. A damaged slot header found at
the disk tier's start-up is a counted error too."""

import io
import logging
import os
import struct
import time

import pytest
import xxhash

from kvtier.engine.metrics import MetricsRegistry
from kvtier.offload.chunk_format import (
    HEADER_BYTES,
    MAC_BYTES,
    ChunkFormatError,
    ChunkSecretError,
    load_chunk_secret,
    read_chunk_into,
    write_chunk,
)
from kvtier.offload.manager import Lookup
from kvtier.offload.tiers.base import LookupResult, TierContext
from kvtier.offload.tiers.disk import DiskTier, DiskTierOptions
from kvtier.offload.tiers.fs import FsTier, FsTierOptions

from .offload_helpers import (
    CHUNK,
    NAMESPACE,
    chunk_bytes,
    key,
    offload_config,
    poll_until,
    store_from_device,
    tier_load,
    tier_store,
)

SECRET = b"s3cret-shared-by-the-fleet"
KEY = b"namespace-and-block-hash"
PAYLOAD = bytes(range(256)) * 4


def _chunk(secret=None, payload=PAYLOAD):
    f = io.BytesIO()
    write_chunk(f, KEY, memoryview(payload), secret)
    return f.getvalue()


def _read(data, secret=SECRET):
    out = bytearray(len(PAYLOAD))
    read_chunk_into(io.BytesIO(data), KEY, memoryview(out), secret)
    return bytes(out)


def _forged(data, payload):
    """`data` with its payload replaced and the checksum recomputed; the MAC (if any) kept."""
    checksum_at = HEADER_BYTES - 16
    with_checksum = data[:checksum_at] + xxhash.xxh3_128(payload).digest() + data[HEADER_BYTES:]
    return with_checksum[:len(with_checksum) - len(payload)] + payload


def test_a_signed_chunk_round_trips_and_reads_without_the_secret_too():
    data = _chunk(SECRET)
    assert len(data) == HEADER_BYTES + len(KEY) + MAC_BYTES + len(PAYLOAD)
    assert _read(data) == PAYLOAD
    assert _read(data, secret=None) == PAYLOAD  # checksum only: nothing to check a MAC with


@pytest.mark.parametrize("data, message", [
    (_chunk(None), "no MAC"),
    (_forged(_chunk(None), PAYLOAD[::-1]), "no MAC"),
    (_forged(_chunk(SECRET), PAYLOAD[::-1]), "MAC mismatch"),
    (_chunk(b"another secret of the same kind"), "MAC mismatch"),
])
def test_with_a_secret_only_chunks_signed_with_it_load(data, message):
    with pytest.raises(ChunkFormatError, match=message):
        _read(data)


def test_without_a_secret_a_forged_checksum_passes():
    # Why the MAC exists: the checksum catches damage, not tampering.
    assert _read(_forged(_chunk(None), PAYLOAD[::-1]), secret=None) == PAYLOAD[::-1]


def test_the_secret_comes_from_a_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("KVTIER_CHUNK_SECRET_FILE", raising=False)
    monkeypatch.delenv("KVTIER_CHUNK_SECRET", raising=False)
    assert load_chunk_secret() is None
    monkeypatch.setenv("KVTIER_CHUNK_SECRET", "from-the-environment!")
    assert load_chunk_secret() == b"from-the-environment!"
    (tmp_path / "secret").write_bytes(SECRET + b"\n")
    monkeypatch.setenv("KVTIER_CHUNK_SECRET_FILE", str(tmp_path / "secret"))
    assert load_chunk_secret() == SECRET  # the file wins; its trailing newline is not secret
    (tmp_path / "other").write_bytes(b"x" * 16)
    assert load_chunk_secret(str(tmp_path / "other")) == b"x" * 16  # the config's file wins


def test_a_bad_secret_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("KVTIER_CHUNK_SECRET_FILE", raising=False)
    monkeypatch.setenv("KVTIER_CHUNK_SECRET", "short")
    with pytest.raises(ChunkSecretError, match=r"\$KVTIER_CHUNK_SECRET has 5 bytes; use at "
                                               r"least 16"):
        load_chunk_secret()
    with pytest.raises(ChunkSecretError, match="cannot read the chunk secret file .*missing"):
        load_chunk_secret(str(tmp_path / "missing"))


# ---- the tiers -------------------------------------------------------------------------------


def _fs(root, secret):
    return FsTier(FsTierOptions(root_dir=str(root)),
                  TierContext("fs", NAMESPACE, chunk_secret=secret))


def _forge_file(path, payload):
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(_forged(data, payload))


def test_fs_tier_refuses_a_forged_chunk_file(tmp_path):
    tier = _fs(tmp_path, SECRET)
    try:
        assert tier_store(tier, 1) and tier_load(tier, 1) == (True, chunk_bytes(1))
        _forge_file(tier.path_for(key(1)), chunk_bytes(2))
        assert tier_load(tier, 1)[0] is False
        assert tier.lookup(key(1)) is LookupResult.NOT_FOUND
        # Without the secret it is an intact chunk of another instance's secret: kept.
        assert os.path.exists(tier.path_for(key(1)))
    finally:
        tier.shutdown()


def test_fs_tier_keeps_another_secrets_intact_chunks_and_drops_damaged_ones(tmp_path):
    other, tier = _fs(tmp_path, b"another secret of the same kind"), _fs(tmp_path, SECRET)
    try:
        assert tier_store(other, 1) and tier_store(other, 2)
        assert tier_load(tier, 1)[0] is False  # a miss here, and the file stays for the others
        assert os.path.exists(tier.path_for(key(1)))
        assert tier_load(other, 1) == (True, chunk_bytes(1))
        with open(tier.path_for(key(2)), "r+b") as f:  # damage 2's last payload byte
            f.seek(-1, os.SEEK_END)
            f.write(bytes([chunk_bytes(2)[-1] ^ 0xFF]))
        assert tier_load(tier, 2)[0] is False
        assert not os.path.exists(tier.path_for(key(2)))  # dropped: a store writes a good one
    finally:
        other.shutdown()
        tier.shutdown()


def test_fs_tier_with_a_secret_refuses_unsigned_chunks(tmp_path):
    unsigned = _fs(tmp_path, None)
    assert tier_store(unsigned, 1)
    unsigned.shutdown()
    tier = _fs(tmp_path, SECRET)
    try:
        assert tier_load(tier, 1)[0] is False
    finally:
        tier.shutdown()


def test_a_forged_chunk_is_a_counted_miss_in_the_manager(make_manager, tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_CHUNK_SECRET", SECRET.decode())
    tiers = [{"type": "fs", "root_dir": str(tmp_path)}]
    manager = make_manager(offload_config(1, tiers))
    store_from_device(manager, 1)
    deadline = time.monotonic() + 10
    while manager.num_jobs_in_flight() and time.monotonic() < deadline:
        manager.poll()
        time.sleep(0.002)
    _forge_file(manager.tiers[0].path_for(key(1)), chunk_bytes(2))
    store_from_device(manager, 3)  # evicts 1 from the single host slot
    manager.poll()
    assert poll_until(manager, 1) is Lookup.MISS
    assert manager.metrics.snapshot()['kvtier:offload_tier_errors_total{tier="fs"}'] == 1


def _disk(root, secret=None, metrics=None):
    return DiskTier(DiskTierOptions(root_dir=str(root), max_bytes="1MiB"),
                    TierContext("disk", NAMESPACE, metrics, max_chunk_bytes=CHUNK,
                                chunk_secret=secret))


def _slot_offset(slot):
    return 4096 + slot * 2 * 4096  # file header page, then (header page + payload page) slots


def test_disk_tier_refuses_a_forged_slot(tmp_path):
    tier = _disk(tmp_path, SECRET)
    try:
        assert tier_store(tier, 1)  # the first free slot: slot 0
        with open(tier.path, "r+b") as f:
            f.seek(_slot_offset(0) + HEADER_BYTES - 16)
            f.write(xxhash.xxh3_128(chunk_bytes(2)).digest())
            f.seek(_slot_offset(0) + 4096)
            f.write(chunk_bytes(2))
        assert tier_load(tier, 1)[0] is False
    finally:
        tier.shutdown()


@pytest.mark.parametrize("damage", ["magic", "key_length", "unsigned"])
def test_disk_tier_counts_damaged_slot_headers_at_start_up(tmp_path, caplog, damage):
    first = _disk(tmp_path, None if damage == "unsigned" else SECRET)
    for n in range(3):
        assert tier_store(first, n)  # slots 0, 1, 2
    first.shutdown()
    if damage != "unsigned":
        with open(first.path, "r+b") as f:
            if damage == "magic":
                f.seek(_slot_offset(1))
                f.write(b"XXXX")
            else:
                f.seek(_slot_offset(1) + 8)
                f.write(struct.pack("<I", 5000))  # past the slot header
    registry = MetricsRegistry()
    with caplog.at_level(logging.WARNING, logger="kvtier.offload.tiers.disk"):
        tier = _disk(tmp_path, SECRET, registry)
    try:
        errors = registry.snapshot()['kvtier:offload_tier_errors_total{tier="disk"}']
        assert errors == (3 if damage == "unsigned" else 1)
        assert caplog.text.count("slot header(s)") == 1
        found = [tier.lookup(key(n)) is LookupResult.FOUND for n in range(3)]
        assert found == ([False] * 3 if damage == "unsigned" else [True, False, True])
    finally:
        tier.shutdown()
    assert os.path.getsize(tier.path) > 0
