"""Headers are checked msgpack maps of known shape; the secret comes from the environment."""

from __future__ import annotations

import msgpack
import pytest

from kvtier.transport import MalformedMessageError, TransportConfig, load_secret, protocol
from kvtier.transport.zmq_state import cut, scatter


def test_every_message_round_trips():
    msg = protocol.decode(protocol.encode("offer", id="t1", sizes=[1, 2, 3], ttl_ms=500))
    assert msg == {"t": "offer", "id": "t1", "sizes": [1, 2, 3], "ttl_ms": 500}
    for kind in ("accept", "data"):
        assert protocol.decode(protocol.encode(kind, id="t1", offset=4 << 20)) == {
            "t": kind, "id": "t1", "offset": 4 << 20}
    # The largest offer a sender may make fits in one header.
    biggest = ["x" * 200, [(1 << 63) - 1] * protocol.MAX_REGIONS]
    frame = protocol.encode("offer", id=biggest[0], sizes=biggest[1], ttl_ms=60_000)
    assert protocol.decode(frame)["sizes"] == biggest[1]
    # So does the largest pull: regions under 4 GiB each, at any 64-bit addresses.
    pull = {"id": "x" * 200, "sizes": [(1 << 32) - 1] * protocol.MAX_REGIONS,
            "session": "10.0.0.5:15357", "addrs": [(1 << 64) - 1] * protocol.MAX_REGIONS,
            "ttl_ms": 60_000}
    assert protocol.decode(protocol.encode("pull", **pull)) == {"t": "pull", **pull}


@pytest.mark.parametrize("frame", [
    b"",
    msgpack.packb([1, 2]),                                          # not a map
    msgpack.packb({"t": "launch"}),                                 # unknown type
    msgpack.packb({"t": "accept"}),                                 # missing field
    msgpack.packb({"t": "accept", "id": "a", "offset": 0, "x": 1}),  # unknown field
    msgpack.packb({"t": "accept", "id": 5, "offset": 0}),           # wrong type
    msgpack.packb({"t": "data", "id": "a", "offset": -1}),          # negative offset
    msgpack.packb({"t": "data", "id": "a", "offset": 1.5}),         # not a byte count
    msgpack.packb({"t": "hello", "v": True, "engine": "e", "ns": "n", "nonce": b"x",
                   "auth": False}),                                 # a bool is not a version
    msgpack.packb({"t": "offer", "id": "a", "sizes": [], "ttl_ms": 9}),    # no regions
    msgpack.packb({"t": "offer", "id": "a", "sizes": [-1], "ttl_ms": 9}),  # negative size
    msgpack.packb({"t": "offer", "id": "a", "sizes": [4], "ttl_ms": 0}),   # the sender gave up
    *[msgpack.packb({"t": "pull", "id": "a", "sizes": [4, 4], "session": "h:1", "addrs": addrs,
                     "ttl_ms": ttl}) for addrs, ttl in [
        ([4096], 10),                                               # an address per size
        ([4096, -1], 10),                                           # negative address
        ([4096, 8192], 0)]],                                        # the sender gave up
    msgpack.packb({"t": "accept", "id": msgpack.ExtType(1, b"x"), "offset": 0}),  # ext type
    msgpack.packb({"t": "accept", "id": "a", "offset": 0}) + b"trailing",
    b"\x81" + msgpack.packb("t") + b"\xc6" + b"\xff" * 4,          # bin longer than the frame
    b"x" * (protocol.MAX_HEADER_BYTES + 1),
])
def test_malformed_headers_are_rejected(frame):
    with pytest.raises(MalformedMessageError):
        protocol.decode(frame)


def test_proofs_bind_secret_nonces_and_ids():
    base = (b"s" * 16, "initiator", b"a", b"b", "ns", "i", "r")
    proof = protocol.prove(*base)
    assert protocol.proof_matches(proof, protocol.prove(*base))
    for i in range(7):
        changed = list(base)
        changed[i] = changed[i] + (b"!" if isinstance(changed[i], bytes) else "!")
        assert not protocol.proof_matches(proof, protocol.prove(*changed))
    assert not protocol.proof_matches(proof, None)


def test_secret_comes_from_env_or_file(tmp_path):
    assert load_secret({}) is None
    assert load_secret({"KVTIER_TRANSPORT_SECRET": "x" * 20}) == b"x" * 20
    path = tmp_path / "secret"
    path.write_bytes(b"y" * 32 + b"\n")
    assert load_secret({"KVTIER_TRANSPORT_SECRET_FILE": str(path)}) == b"y" * 32
    with pytest.raises(ValueError, match="only one"):
        load_secret({"KVTIER_TRANSPORT_SECRET": "x" * 20,
                     "KVTIER_TRANSPORT_SECRET_FILE": str(path)})
    with pytest.raises(ValueError, match="at least 16"):
        load_secret({"KVTIER_TRANSPORT_SECRET": "short"})
    with pytest.raises(ValueError, match="cannot read"):
        load_secret({"KVTIER_TRANSPORT_SECRET_FILE": str(tmp_path / "missing")})


def test_config_checks_its_fields():
    with pytest.raises(ValueError, match="32-byte"):
        TransportConfig(namespace=b"short")
    with pytest.raises(ValueError, match="port"):
        TransportConfig(namespace=bytes(32), port=70000)
    with pytest.raises(ValueError, match="zmq, mooncake"):
        TransportConfig(namespace=bytes(32), backend="nixl")


def test_scatter_copies_across_unequal_cuts():
    data = bytes(range(100))
    parts = [memoryview(data)[:7], memoryview(data)[7:50], memoryview(data)[50:]]
    out = [bytearray(30), bytearray(0), bytearray(1), bytearray(69)]
    scatter(parts, [memoryview(b) for b in out])
    assert b"".join(out) == data


def test_cut_and_scatter_at_an_offset_move_every_byte_once():
    data = bytes(range(256)) * 4
    views = [memoryview(data)[a:b] for a, b in [(0, 100), (100, 100), (100, 613), (613, 1024)]]
    for start, stop in [(0, 1024), (0, 1), (99, 101), (100, 613), (500, 1024), (1023, 1024)]:
        assert b"".join(cut(views, start, stop)) == data[start:stop]
    out = [bytearray(n) for n in (7, 0, 500, 517)]
    out_views = [memoryview(b) for b in out]
    for start, stop in [(0, 5), (5, 7), (7, 600), (600, 1024)]:  # pieces in order, as data come
        scatter(cut(views, start, stop), out_views, start)
    assert b"".join(out) == data
