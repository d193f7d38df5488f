"""The ZMQ KV event publisher under load and misuse (real sockets on 127.0.0.1): batches it
loses still take their seq, a replay client holds up neither the live stream nor the stop, and
replay answers come whole while oversized requests are refused."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvtier.engine import kv_events
from kvtier.engine.kv_events import END_SEQ, KVEventsConfig, ZmqEventPublisher
from kvtier.engine.metrics import MetricsRegistry
from kvtier.events import BlockRemoved, BlockStored, decode_batch

from ..entrypoints.server_process import free_port

DEADLINE_S = 10.0


def removed(block_hash: int) -> list[BlockRemoved]:
    return [BlockRemoved([block_hash], "GPU")]


@contextlib.contextmanager
def publishing(**options) -> Iterator[tuple[ZmqEventPublisher, zmq.Socket, int]]:
    """A publisher with a replay socket, a SUB socket that receives all it publishes from now
    on, and the number of batches it published to get there (their seqs come first)."""
    publisher = ZmqEventPublisher(KVEventsConfig(
        enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{free_port()}",
        replay_endpoint=f"tcp://127.0.0.1:{free_port()}", **options))
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVTIMEO, int(DEADLINE_S * 1000))
        sub.connect(publisher.config.endpoint)
        yield publisher, sub, _subscribed(publisher, sub)
    finally:
        ctx.destroy(linger=0)
        publisher.shutdown()


def _subscribed(publisher: ZmqEventPublisher, sub: zmq.Socket) -> int:
    """Publish until `sub` receives (PUB drops what it sends before the subscription arrives),
    then take what is still on its way; the number published."""
    deadline = time.monotonic() + DEADLINE_S
    num_published = 0
    while True:
        assert time.monotonic() < deadline, "the subscription never reached the publisher"
        publisher.publish(removed(10**9))
        num_published += 1
        if sub.poll(100):
            break
    while seq_of(sub.recv_multipart()) != num_published - 1:
        pass
    return num_published


def seq_of(frames: list[bytes]) -> int:
    return int.from_bytes(frames[-2], "big")


def received(sub: zmq.Socket, count: int) -> list[tuple[int, list[int]]]:
    """(seq, block hashes) of the next `count` batches on `sub`."""
    batches = []
    for _ in range(count):
        _, seq, payload = sub.recv_multipart()
        hashes = [h for event in decode_batch(payload).events for h in event.block_hashes]
        batches.append((int.from_bytes(seq, "big"), hashes))
    return batches


def replay_answer(asker: zmq.Socket) -> list[int]:
    """The seqs of the replay answer on `asker`, up to its END (which must come)."""
    seqs = []
    while (frames := asker.recv_multipart())[-2] != END_SEQ:
        seqs.append(seq_of(frames))
    return seqs


def asker_of(ctx: zmq.Context, publisher: ZmqEventPublisher,
             **options: int | bytes) -> zmq.Socket:
    """A DEALER connected to the replay socket, with these zmq options."""
    asker = ctx.socket(zmq.DEALER)
    asker.setsockopt(zmq.LINGER, 0)
    asker.setsockopt(zmq.RCVTIMEO, int(DEADLINE_S * 1000))
    for option, value in options.items():
        asker.setsockopt(getattr(zmq, option), value)
    asker.connect(publisher.config.replay_endpoint)
    return asker


def test_batches_dropped_on_a_full_queue_take_their_seq_and_are_logged_once(
        monkeypatch, caplog):
    stalled, release = threading.Event(), threading.Event()
    encode = kv_events.encode_events

    def stalling(ts, events, *args):
        if events[0].block_hashes == [1]:  # the publisher thread waits here with batch 1
            stalled.set()
            assert release.wait(DEADLINE_S)
        return encode(ts, events, *args)

    monkeypatch.setattr(kv_events, "encode_events", stalling)
    metrics = MetricsRegistry()
    with publishing(max_queue_size=1) as (publisher, sub, base), \
            caplog.at_level(logging.WARNING, logger="kvtier.engine.kv_events"):
        publisher.count_lost_in(metrics)
        publisher.publish(removed(1))
        assert stalled.wait(DEADLINE_S)
        for block_hash in (2, 3, 4):  # 2 fills the queue; 3 and 4 are dropped
            publisher.publish(removed(block_hash))
        release.set()
        assert received(sub, 2) == [(base, [1]), (base + 1, [2])]
        publisher.publish(removed(5))
        # 3 and 4 took base + 2 and base + 3: a subscriber sees the gap, and the replay
        # has nothing for it.
        assert received(sub, 1) == [(base + 4, [5])]
        asker = asker_of(sub.context, publisher)
        asker.send_multipart([b"", base.to_bytes(8, "big")])
        assert replay_answer(asker) == [base, base + 1, base + 4]
    assert publisher.num_dropped == 2
    assert lost_batches(metrics) == {"queue_full": 2.0, "encode_error": 0.0}
    assert [r.getMessage() for r in caplog.records] == [
        "KV event publisher dropped a batch (1 so far): its queue of 1 batches is full (the "
        "publisher thread falls behind); subscribers see the gap and resync"]


def test_a_batch_that_cannot_be_encoded_takes_its_seq():
    metrics = MetricsRegistry()
    with publishing() as (publisher, sub, base):
        publisher.publish([object()])
        publisher.publish(removed(7))
        assert received(sub, 1) == [(base + 1, [7])]
        publisher.count_lost_in(metrics)  # counts what was lost before it, too
        publisher.publish([object()])
        publisher.publish(removed(8))
        assert received(sub, 1) == [(base + 3, [8])]
    assert publisher.num_encode_errors == 2
    assert lost_batches(metrics) == {"queue_full": 0.0, "encode_error": 2.0}


def lost_batches(metrics: MetricsRegistry) -> dict[str, float]:
    """cause -> kvtier:kv_events_lost_batches_total, from the registry's exposition."""
    found = {}
    for line in metrics.render().decode().splitlines():
        if line.startswith("kvtier:kv_events_lost_batches_total{"):
            key, _, value = line.rpartition(" ")
            found[key.split('cause="')[1].split('"')[0]] = float(value)
    return found


def test_a_replay_client_that_keeps_asking_holds_up_neither_live_batches_nor_the_stop():
    with publishing(buffer_steps=1000) as (publisher, sub, base):
        for block_hash in range(1000):
            publisher.publish(removed(block_hash))
        assert [seq for seq, _ in received(sub, 1000)] == list(range(base, base + 1000))
        asker = asker_of(sub.context, publisher, SNDHWM=0)
        for _ in range(100_000):  # each asks for the whole buffer; none is read but the first
            asker.send_multipart([b"", (0).to_bytes(8, "big")])
        assert asker.poll(int(DEADLINE_S * 1000))  # the publisher is answering them
        publisher.publish(removed(5000))
        assert received(sub, 1) == [(base + 1000, [5000])]
        publisher.shutdown(timeout_s=DEADLINE_S)
        assert not publisher._thread.is_alive()


def test_a_long_replay_answer_comes_whole_to_a_client_that_reads_it_late():
    """The answer holds more messages than zmq's default send limit (1000): none may be cut
    while the client is busy before it reads."""
    tokens = list(range(2048))
    with publishing(buffer_steps=4000) as (publisher, sub, base):
        for block_hash in range(3000):
            publisher.publish([BlockStored([block_hash], None, tokens, 16, None, "GPU")])
        assert len(received(sub, 3000)) == 3000
        asker = asker_of(sub.context, publisher, RCVHWM=1, RCVBUF=4096)
        asker.send_multipart([b"", base.to_bytes(8, "big")])
        for marker in range(3):  # the publisher went through its loop since the request came
            publisher.publish(removed(marker))
            received(sub, 1)
        seqs = replay_answer(asker)
    assert seqs[:3000] == list(range(base, base + 3000))
    assert seqs == list(range(base, base + len(seqs)))  # and the markers, if they came first


def test_a_replay_frame_larger_than_a_request_disconnects_its_client():
    with publishing() as (publisher, sub, base):
        ctx = sub.context
        asker = ctx.socket(zmq.DEALER)
        asker.setsockopt(zmq.LINGER, 0)
        events = asker.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        events.setsockopt(zmq.RCVTIMEO, int(DEADLINE_S * 1000))
        asker.connect(publisher.config.replay_endpoint)
        # A start seq of 0, padded to 1 MiB: zmq drops the client on the frame's size.
        asker.send_multipart([b"", bytes(1 << 20)])
        assert recv_monitor_message(events)["event"] == zmq.EVENT_DISCONNECTED
        # A request comes through from a client with the longest routing id zmq allows.
        asker = asker_of(ctx, publisher, ROUTING_ID=b"r" * 255)
        asker.send_multipart([b"", (0).to_bytes(8, "big")])
        assert replay_answer(asker) == list(range(base))
