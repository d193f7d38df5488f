"""The p2p tier between two tiering managers in one process, over real sockets on 127.0.0.1: one
serves its host tier (`listen`), the other promotes what it misses from there (`peers`). Lookups
never wait, chunks arrive checked, stores are skipped, and a refused, dead or lying peer costs
misses and counted errors, never wrong bytes or a hang."""

import time

import pytest
import zmq

from kvtier.offload.config import OffloadConfig, parse_kv_offload
from kvtier.offload.host_area import HostArea
from kvtier.offload.manager import Lookup, TieringManager
from kvtier.offload.tiers import p2p, p2p_wire
from kvtier.offload.tiers.base import LookupResult
from kvtier.offload.tiers.p2p import SKIP_REASON, P2PTierOptions

from .offload_helpers import (
    CHUNK,
    chunk_bytes,
    drain,
    key,
    offload_config,
    poll_until,
    read_host,
    store_from_device,
    tier_job,
    wait_jobs,
)


def _serving(make_manager, **options):
    """A manager whose p2p tier serves its host tier on a free port; (manager, "HOST:PORT")."""
    manager = make_manager(offload_config(8, [{"type": "p2p", "listen": "127.0.0.1:0",
                                               **options}]))
    return manager, manager.tiers[0].address


def _asking(make_manager, *peers, **options):
    return make_manager(offload_config(8, [{"type": "p2p", "peers": list(peers), **options}]))


def _metric(manager, name, **labels):
    label = ",".join(f'{k}="{v}"' for k, v in {"tier": "p2p", **labels}.items())
    return manager.metrics.snapshot().get(f"kvtier:{name}_total{{{label}}}", 0.0)


def test_a_host_miss_is_promoted_from_the_peers_host_memory(make_manager):
    server, address = _serving(make_manager)
    for n in (1, 2):
        store_from_device(server, n)
    asking = _asking(make_manager, address)
    assert asking.lookup(key(1), CHUNK) is Lookup.RETRY  # the peer is asked off this thread
    assert poll_until(asking, 1) is Lookup.HIT
    assert poll_until(asking, 2) is Lookup.HIT
    assert [read_host(asking, n) for n in (1, 2)] == [chunk_bytes(1), chunk_bytes(2)]
    assert poll_until(asking, 3) is Lookup.MISS  # the peer never had it
    assert _metric(asking, "offload_tier_hits") == 2
    assert _metric(asking, "offload_tier_queries") == 3
    assert server.tiers[0]._server.counts["served"] == 2
    # The peer's reads pinned and released their slots: once the skipped stores are collected,
    # every chunk there is evictable again.
    drain(server)
    assert server.host.num_evictable_now() == 8


def test_stores_are_skipped_with_a_reason(make_manager):
    server, address = _serving(make_manager)
    store_from_device(server, 1)  # write_through: the p2p tier is offered the chunk
    deadline = time.monotonic() + 5
    while _metric(server, "offload_tier_dropped_stores", reason=SKIP_REASON) < 1:
        assert time.monotonic() < deadline, "the skipped store is never reported"
        server.poll()
        time.sleep(0.005)
    assert server.num_jobs_in_flight() == 0
    assert _metric(server, "offload_tier_errors") == 0
    job = tier_job(1)
    server.tiers[0].submit_store(job)
    assert wait_jobs(server.tiers[0], [job.job_id]) == {job.job_id: False}


def test_a_peer_with_another_namespace_is_refused_and_counted(make_manager):
    server, address = _serving(make_manager)
    store_from_device(server, 1)
    config = offload_config(8, [{"type": "p2p", "peers": [address]}])
    other = TieringManager(config, bytes(32), HostArea(config.cpu_bytes_to_use, CHUNK))
    try:
        assert poll_until(other, 1) is Lookup.MISS
        assert other.tiers[0].counts["refused_namespace"] == 1
        assert server.tiers[0]._server.counts["refused_namespace"] == 1
        assert server.tiers[0]._server.counts["served"] == 0
    finally:
        other.shutdown()


def test_a_chunk_that_fails_its_check_is_a_miss_and_an_error(make_manager, monkeypatch):
    monkeypatch.setenv("KVTIER_CHUNK_SECRET", "the serving side's secret")
    server, address = _serving(make_manager)
    store_from_device(server, 1)
    monkeypatch.setenv("KVTIER_CHUNK_SECRET", "another secret, another MAC")
    asking = _asking(make_manager, address)
    assert poll_until(asking, 1) is Lookup.MISS
    assert _metric(asking, "offload_tier_errors") == 1
    assert server.tiers[0]._server.counts["served"] == 1


def test_a_dead_peer_costs_misses_within_the_deadline_and_comes_back(make_manager):
    server, address = _serving(make_manager)
    port = address.rpartition(":")[2]
    server.shutdown()  # nothing listens there now
    asking = _asking(make_manager, address, connect_timeout_s=0.2, timeout_s=0.3)
    start = time.monotonic()
    assert poll_until(asking, 1) is Lookup.MISS
    assert time.monotonic() - start < 2.0
    revived = make_manager(offload_config(8, [{"type": "p2p", "listen": f"127.0.0.1:{port}"}]))
    store_from_device(revived, 1)
    deadline = time.monotonic() + 10
    while (answer := poll_until(asking, 1)) is not Lookup.HIT:
        assert answer is Lookup.MISS and time.monotonic() < deadline, "the peer never comes back"
        time.sleep(0.1)
    assert read_host(asking, 1) == chunk_bytes(1)


def test_a_lookup_never_waits_on_a_silent_peer(make_manager):
    asking = _asking(make_manager, "127.0.0.1:9", connect_timeout_s=1.0)
    start = time.monotonic()
    assert asking.tiers[0].lookup(key(5)) is LookupResult.UNKNOWN
    assert time.monotonic() - start < 0.05


def test_the_flag_form_makes_one_tier_that_asks_and_serves():
    extra = parse_kv_offload("host=1GiB,p2p=10.0.0.2:7100;10.0.0.3:7100,p2p_listen=0.0.0.0:7100")
    (spec,) = OffloadConfig.from_extra_config(extra).secondary_tiers
    assert spec.type == "p2p"
    assert spec.options == P2PTierOptions(peers=("10.0.0.2:7100", "10.0.0.3:7100"),
                                          listen="0.0.0.0:7100")


@pytest.mark.parametrize("flag, message", [
    ("host=1GiB,p2p=10.0.0.2", "p2p.peers must be HOST:PORT"),
    ("host=1GiB,p2p_listen=:7100", "p2p.listen must be HOST:PORT"),
])
def test_bad_addresses_are_named(flag, message):
    with pytest.raises(ValueError, match=message):
        OffloadConfig.from_extra_config(parse_kv_offload(flag))


def test_a_tier_with_neither_peers_nor_listen_is_an_error():
    with pytest.raises(ValueError, match="p2p needs peers to ask or an address to listen on"):
        P2PTierOptions()



def test_a_peer_that_dies_between_lookup_and_fetch_fails_the_load_in_time(make_manager):
    server, address = _serving(make_manager)
    store_from_device(server, 1)
    asking = _asking(make_manager, address, timeout_s=0.5)
    tier = asking.tiers[0]
    assert _settled(tier, 1) is LookupResult.FOUND
    server.shutdown()
    out = memoryview(bytearray(CHUNK))
    job = tier_job(1, out)
    start = time.monotonic()
    tier.submit_load(job)
    assert wait_jobs(tier, [job.job_id]) == {job.job_id: False}
    assert time.monotonic() - start < 2.0


def test_the_serving_side_drops_garbage_and_refuses_requests_before_the_handshake(
        make_manager):
    server, address = _serving(make_manager)
    store_from_device(server, 1)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{address}")
    try:
        sock.send(b"\xc1 is no msgpack")
        sock.send(p2p_wire.encode("get", n=1, key=key(1)))
        assert sock.poll(5000), "the serving side never answers"
        reply = p2p_wire.decode(sock.recv())
        assert (reply["t"], reply["code"]) == ("refused", "protocol")
    finally:
        sock.close()
        ctx.term()
    counts = server.tiers[0]._server.counts
    assert (counts["malformed"], counts["served"], counts["refused_protocol"]) == (1, 0, 1)
    asking = _asking(make_manager, address)  # and it goes on serving the others
    assert poll_until(asking, 1) is Lookup.HIT


def test_a_peers_hit_is_asked_again_after_a_while(make_manager, monkeypatch):
    monkeypatch.setattr(p2p, "_FOUND_S", 0.2)
    server, address = _serving(make_manager)
    store_from_device(server, 1)
    tier = _asking(make_manager, address).tiers[0]
    assert _settled(tier, 1) is LookupResult.FOUND
    for n in range(2, 10):  # the peer's 8 slots fill up: chunk 1 is evicted there
        drain(server)
        store_from_device(server, n)
    assert not server.host.is_ready(key(1))
    assert tier.lookup(key(1)) is LookupResult.FOUND  # still trusted
    time.sleep(0.3)
    assert _settled(tier, 1) is LookupResult.NOT_FOUND


def _settled(tier, n):
    deadline = time.monotonic() + 5
    while (answer := tier.lookup(key(n))) is LookupResult.UNKNOWN:
        assert time.monotonic() < deadline, "the peer's answer never arrives"
        time.sleep(0.005)
    return answer


def test_a_refused_peer_that_retries_is_logged_once(caplog):
    from kvtier.offload.tiers.p2p_server import P2PServer
    from kvtier.transport.handshake import LocalIdentity

    ctx = zmq.Context()
    server = P2PServer(ctx, "tcp://127.0.0.1:*", None, LocalIdentity("srv", "aa" * 32, None),
                       None)
    client = p2p_wire.PeerClient(ctx, server.address, LocalIdentity("cli", "bb" * 32, None),
                                 1 << 20, 2.0, 2.0)
    try:
        with caplog.at_level("WARNING", logger="kvtier.transport.handshake"):
            for _ in range(20):  # each try on a new socket, so a new zmq routing id
                with pytest.raises(p2p_wire.PeerRefused):
                    client.has([key(1)])
        assert server.counts["refused_namespace"] == 20
        assert [r.getMessage().count("refused peer cli") for r in caplog.records] == [1]
    finally:
        client.close()
        assert server.shutdown(2.0)
        ctx.term()
