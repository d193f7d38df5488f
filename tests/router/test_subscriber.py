"""Following a real ZMQ event publisher: history on start, gaps replayed or resynced."""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgpack
import zmq

from kvtier.engine.kv_events import KVEventsConfig, ZmqEventPublisher, encode_events
from kvtier.kv import BlockRemoved
from kvtier.router.subscriber import EventSubscriber, instance_endpoint

from ..entrypoints.server_process import free_port

DEADLINE_S = 10.0


def removed(i: int) -> BlockRemoved:
    return BlockRemoved([i.to_bytes(32, "big")], "device", 0)


class Recorder:
    """What the subscriber hands on: the block hash of each batch applied, resets, gaps."""

    def __init__(self) -> None:
        self.applied: list[int] = []
        self.resets: list[str] = []
        self.gaps: list[str] = []

    def subscriber(self, publisher: ZmqEventPublisher) -> EventSubscriber:
        config = publisher.config
        return EventSubscriber(config.endpoint, config.replay_endpoint, config.topic,
                               apply=lambda b: self.applied.extend(e.block_hashes[0]
                                                                   for e in b.events),
                               reset=self.resets.append, on_gap=self.gaps.append)


def start_publisher(buffer_steps: int = 100) -> ZmqEventPublisher:
    return ZmqEventPublisher(KVEventsConfig(
        enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{free_port()}",
        replay_endpoint=f"tcp://127.0.0.1:{free_port()}", buffer_steps=buffer_steps))


def wait_published(publisher: ZmqEventPublisher, num: int) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while publisher._seq < num:  # the publisher thread numbers what it has sent
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_the_first_batch_received_replays_the_history_before_it():
    publisher = start_publisher()
    recorder = Recorder()

    async def follow() -> None:
        task = asyncio.create_task(recorder.subscriber(publisher).run())
        await asyncio.sleep(0.5)  # connected; batches 0-2 went out before: missed
        publisher.publish([removed(3)])
        deadline = time.monotonic() + DEADLINE_S
        while len(recorder.applied) < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    try:
        for i in range(3):
            publisher.publish([removed(i)])
        wait_published(publisher, 3)
        asyncio.run(follow())
    finally:
        publisher.shutdown()
    assert recorder.applied == [0, 1, 2, 3] and recorder.resets == [] and recorder.gaps == []


def test_a_gap_is_filled_from_the_replay_buffer():
    publisher = start_publisher()
    recorder = Recorder()
    try:
        for i in range(4):
            publisher.publish([removed(i)])
        wait_published(publisher, 4)
        subscriber = recorder.subscriber(publisher)

        async def receive() -> None:
            await subscriber.receive(0, encode_events(0.0, [removed(0)]))
            await subscriber.receive(3, encode_events(0.0, [removed(3)]))  # 1 and 2 missed

        asyncio.run(receive())
    finally:
        publisher.shutdown()
    assert recorder.applied == [0, 1, 2, 3] and recorder.gaps == ["detected", "replayed"]
    assert recorder.resets == [] and subscriber.next_seq == 4


def test_a_gap_the_buffer_no_longer_holds_resets_the_instance():
    publisher = start_publisher(buffer_steps=2)
    recorder = Recorder()
    try:
        for i in range(5):
            publisher.publish([removed(i)])
        wait_published(publisher, 5)
        subscriber = recorder.subscriber(publisher)

        async def receive() -> None:
            await subscriber.receive(0, encode_events(0.0, [removed(0)]))
            await subscriber.receive(4, encode_events(0.0, [removed(4)]))  # 1-3 gone
            await subscriber.receive(0, encode_events(0.0, [removed(9)]))  # a restart

        asyncio.run(receive())
    finally:
        publisher.shutdown()
    assert recorder.gaps == ["detected", "lost"]
    assert recorder.resets == ["lost", "restarted"] and recorder.applied == [0, 4, 9]


def test_a_gap_the_replay_answers_with_a_batch_missing_resets_the_instance():
    publisher = start_publisher()
    recorder = Recorder()
    try:
        publisher.publish([removed(0)])
        publisher.publish([removed(1)])
        publisher.publish([object()])  # seq 2: it cannot be encoded, so never sent nor kept
        publisher.publish([removed(3)])
        wait_published(publisher, 4)
        subscriber = recorder.subscriber(publisher)

        async def receive() -> None:
            await subscriber.receive(0, encode_events(0.0, [removed(0)]))
            await subscriber.receive(3, encode_events(0.0, [removed(3)]))  # replays 1, not 2

        asyncio.run(receive())
    finally:
        publisher.shutdown()
    assert recorder.gaps == ["detected", "lost"] and recorder.resets == ["lost"]
    assert recorder.applied == [0, 3]


def test_history_with_a_batch_missing_is_applied_from_after_it():
    publisher = start_publisher()
    recorder = Recorder()
    try:
        publisher.publish([removed(0)])
        publisher.publish([object()])  # seq 1: lost
        publisher.publish([removed(2)])
        wait_published(publisher, 3)
        subscriber = recorder.subscriber(publisher)
        asyncio.run(subscriber.receive(3, encode_events(0.0, [removed(3)])))
    finally:
        publisher.shutdown()
    # Batch 0 may hold blocks that the lost batch 1 removed: it is not applied.
    assert recorder.applied == [2, 3] and recorder.resets == [] and recorder.gaps == []


def test_batches_that_cannot_be_decoded_are_skipped_and_the_subscription_goes_on():
    recorder = Recorder()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)  # says when the subscription arrived
    pub.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub.bind(endpoint)
    undecodable = [[0.0, [], float("inf")],  # a rank that int() cannot take
                   [0.0, [{"type": "BlockStored", "block_hashes": [1], "block_size":
                           float("inf"), "medium": "GPU"}], 0],
                   [float("nan"), [], 0]]
    payloads = [encode_events(0.0, [removed(0)]), *map(msgpack.packb, undecodable),
                encode_events(0.0, [removed(4)])]
    subscriber = EventSubscriber(endpoint, None, "", apply=lambda b: recorder.applied.extend(
        e.block_hashes[0] for e in b.events), reset=recorder.resets.append,
        on_gap=recorder.gaps.append)

    async def follow() -> None:
        task = asyncio.create_task(subscriber.run())
        deadline = time.monotonic() + DEADLINE_S
        while not pub.poll(0):  # the subscription message
            assert time.monotonic() < deadline and not task.done()
            await asyncio.sleep(0.01)
        for seq, payload in enumerate(payloads):
            pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        while len(recorder.applied) < 2 and not task.done():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert not task.done()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    try:
        asyncio.run(follow())
    finally:
        ctx.destroy(linger=0)
    assert recorder.applied == [0, 4] and recorder.resets == [] and recorder.gaps == []
    assert subscriber.next_seq == len(payloads)


def test_a_wildcard_bind_address_becomes_the_instances_host():
    assert instance_endpoint("tcp://*:5557", "http://10.0.0.7:8000") == "tcp://10.0.0.7:5557"
    assert instance_endpoint("tcp://0.0.0.0:5557", "http://h:8000") == "tcp://h:5557"
    assert instance_endpoint("tcp://127.0.0.1:5557", "http://h:8000") == "tcp://127.0.0.1:5557"
    assert instance_endpoint("ipc:///tmp/kv", "http://h:8000") == "ipc:///tmp/kv"
