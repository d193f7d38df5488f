"""KV event wire format and the ZMQ publisher (real sockets on 127.0.0.1)."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from kvtier import events as wire
from kvtier.engine.kv_events import (
    END_SEQ,
    KVEventsConfig,
    KVEventsConfigError,
    ZmqEventPublisher,
    encode_events,
    make_event_publisher,
    to_wire_event,
)
from kvtier.kv import AllBlocksCleared, BlockRemoved, BlockStored

from . import vllm_event_structs as vllm
from .server_process import free_port

HASH_A = bytes(range(32))
HASH_B = bytes([0xFF] * 32)
RECV_DEADLINE_MS = 5000


def encode_event(event, include_token_ids=True):
    return wire.encode_event(to_wire_event(event, include_token_ids))


def test_events_encode_in_vllm_layout():
    stored = BlockStored([HASH_A, HASH_B], None, [1, 2, 3, 4], 2, "adapter", "device", 0,
                         kind="sliding_window", sliding_window=8)
    removed = BlockRemoved([HASH_B], "device", 1)
    low_a = int.from_bytes(HASH_A[-8:], "big")
    # vLLM's tagged maps; kvtier names adapters (lora_name) rather than numbering them.
    assert encode_event(stored) == {
        "type": "BlockStored", "block_hashes": [low_a, 2 ** 64 - 1], "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": None, "medium": "GPU",
        "lora_name": "adapter", "group_idx": 0, "kv_cache_spec_kind": "sliding_window",
        "kv_cache_spec_sliding_window": 8, "locality": "LOCAL"}
    assert encode_event(removed) == {"type": "BlockRemoved", "block_hashes": [2 ** 64 - 1],
                                     "medium": "GPU", "group_idx": 1, "locality": "LOCAL"}
    assert encode_event(AllBlocksCleared()) == {"type": "AllBlocksCleared"}
    payload = encode_events(12.5, [removed, AllBlocksCleared()])
    assert wire.decode_batch(payload) == wire.EventBatch(
        12.5, [wire.BlockRemoved([2 ** 64 - 1], "GPU", 1), wire.AllBlocksCleared()])


def test_vllms_own_structs_decode_every_event_kvtier_sends():
    tier_store = wire.BlockStored([5, 6], None, [], 16, None, "STORAGE", group_idx=0,
                                  locality="remote", ownership="obj")
    tier_drop = wire.BlockRemoved([5], "CPU", 0)
    engine = [BlockStored([HASH_A], HASH_B, [1, 2], 2, None, "device", 0, kind="full_attention"),
              BlockRemoved([HASH_A], "device", 0), AllBlocksCleared()]
    batch = vllm.decode(encode_events(3.0, [*engine, tier_store, tier_drop]))
    assert (batch.ts, batch.data_parallel_rank) == (3.0, 0)
    stored, removed, cleared, to_tier, dropped = batch.events
    assert (stored.parent_block_hash, stored.kv_cache_spec_kind, stored.medium) == (
        2 ** 64 - 1, "full_attention", "GPU")
    assert (removed.group_idx, type(cleared).__name__) == (0, "AllBlocksCleared")
    assert (to_tier.medium, to_tier.locality, to_tier.ownership) == ("STORAGE", "REMOTE", "obj")
    assert (dropped.medium, dropped.locality, dropped.ownership) == ("CPU", "LOCAL", None)


def test_decode_reads_vllm_events_old_and_new_and_refuses_garbage():
    # vLLM 0.32's maps, with fields kvtier does not use; then vLLM's older arrays.
    new = vllm.encode(vllm.EventBatch(1.0, [
        vllm.BlockStored([7], None, [], 16, 3, "STORAGE", "a", extra_keys=[("salt",)],
                         group_idx=0, locality="REMOTE", ownership="lmcache", session_id="s"),
        vllm.BlockRemoved([7], None)], 0))
    assert wire.decode_batch(new).events == [
        wire.BlockStored([7], None, [], 16, 3, "STORAGE", "a", group_idx=0, locality="remote",
                         ownership="lmcache"),
        wire.BlockRemoved([7], "GPU")]  # a medium left unset is the device cache's
    old = msgpack.packb([1.0, [["BlockStored", [7], None, [], 16, None, "GPU", None, None, 0],
                               ["SomeNewEvent", 1]]])
    assert wire.decode_batch(old).events == [wire.BlockStored([7], None, [], 16, None, "GPU")]
    for bad in (b"\xc1", msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": ["x"]}]]),
                msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [1],
                                      "locality": "far"}]]),
                msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1]}]])):
        with pytest.raises(wire.EventDecodeError, match="not a KV event batch"):
            wire.decode_batch(bad)


def test_token_ids_can_be_left_out():
    stored = BlockStored([HASH_A], None, [1, 2, 3, 4], 4, None, "device", 0)
    assert encode_event(stored, include_token_ids=False)["token_ids"] == []
    payload = msgpack.unpackb(encode_events(1.0, [stored], include_token_ids=False))
    assert payload[1][0]["token_ids"] == []
    config = KVEventsConfig.from_json('{"enable_kv_cache_events": true, '
                                      '"include_token_ids": false}')
    assert config.include_token_ids is False and KVEventsConfig().include_token_ids is True
    with pytest.raises(KVEventsConfigError, match="include_token_ids must be true or false"):
        KVEventsConfig(include_token_ids="no")


def test_config_defaults_and_errors():
    config = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "topic": "t"}')
    assert (config.publisher, config.endpoint, config.is_publishing) == \
        ("zmq", "tcp://127.0.0.1:5557", True)
    assert KVEventsConfig().publisher == "null"
    with pytest.raises(KVEventsConfigError, match="unknown kv_events_config key"):
        KVEventsConfig.from_dict({"enable_kv_cache_events": True, "endpoit": "x"})
    with pytest.raises(KVEventsConfigError, match="publisher"):
        KVEventsConfig(enable_kv_cache_events=True, publisher="kafka")
    with pytest.raises(KVEventsConfigError, match="endpoint"):
        KVEventsConfig(endpoint="127.0.0.1:5557")
    with pytest.raises(KVEventsConfigError, match="not valid JSON"):
        KVEventsConfig.from_json("{")
    assert type(make_event_publisher(None)).__name__ == "EventPublisher"


def test_publisher_sends_sequenced_batches_and_replays():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    publisher = ZmqEventPublisher(KVEventsConfig(
        enable_kv_cache_events=True, endpoint=endpoint, replay_endpoint=replay_endpoint,
        topic="kv"))
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.setsockopt(zmq.RCVTIMEO, RECV_DEADLINE_MS)
    sub.connect(endpoint)
    replay = context.socket(zmq.DEALER)
    replay.setsockopt(zmq.RCVTIMEO, RECV_DEADLINE_MS)
    replay.connect(replay_endpoint)
    try:
        time.sleep(0.5)  # let the subscription reach the PUB socket
        publisher.publish([BlockRemoved([HASH_A], "device", 0)])
        publisher.publish([AllBlocksCleared()])
        received = [sub.recv_multipart() for _ in range(2)]
        assert [(t, int.from_bytes(s, "big")) for t, s, _ in received] == [(b"kv", 0),
                                                                           (b"kv", 1)]
        assert msgpack.unpackb(received[1][2])[1] == [{"type": "AllBlocksCleared"}]
        replay.send_multipart([b"", (1).to_bytes(8, "big")])
        first = replay.recv_multipart()
        end = replay.recv_multipart()
        # vLLM 0.32's replay framing: [topic, seq, payload], then [b"", END_SEQ, b""].
        assert first == [b"", b"kv", (1).to_bytes(8, "big"), received[1][2]]
        assert end == [b"", b"", END_SEQ, b""]
    finally:
        sub.close(linger=0)
        replay.close(linger=0)
        publisher.shutdown()


def test_taken_port_fails_at_start():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    first = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint))
    try:
        with pytest.raises(KVEventsConfigError, match="cannot bind"):
            ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint))
    finally:
        first.shutdown()


def test_an_unencodable_batch_is_dropped_and_later_ones_still_go_out():
    # Bug fixed in review: the encoding error killed the publisher thread, so every later
    # batch was silently lost.
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    publisher = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True,
                                                 endpoint=endpoint))
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, RECV_DEADLINE_MS)
    sub.connect(endpoint)
    try:
        time.sleep(0.5)  # let the subscription reach the PUB socket
        publisher.publish([object()])
        publisher.publish([AllBlocksCleared()])
        _, seq, payload = sub.recv_multipart()
        # The batch that could not be encoded took seq 0: subscribers see a gap.
        assert int.from_bytes(seq, "big") == 1
        assert msgpack.unpackb(payload)[1] == [{"type": "AllBlocksCleared"}]
        assert publisher.num_encode_errors == 1
    finally:
        sub.close(linger=0)
        publisher.shutdown()


def test_publisher_without_token_ids_sends_none():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    publisher = make_event_publisher(KVEventsConfig.from_json(
        f'{{"enable_kv_cache_events": true, "endpoint": "{endpoint}", '
        f'"include_token_ids": false}}'))
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, RECV_DEADLINE_MS)
    sub.connect(endpoint)
    try:
        time.sleep(0.5)  # let the subscription reach the PUB socket
        publisher.publish([BlockStored([HASH_A], None, [7, 8, 9, 10], 4, None, "device", 0)])
        event = msgpack.unpackb(sub.recv_multipart()[2])[1][0]
        assert event["type"] == "BlockStored" and event["token_ids"] == []
    finally:
        sub.close(linger=0)
        publisher.shutdown()
