"""Publishes the engine's KV cache events over ZMQ in the layout vLLM's consumers read.

The wire schema (message layout, event fields, media, locality) is `kvtier.events`; this module
turns the engine's events into it: the device cache's BlockStored / BlockRemoved / AllBlocksCleared
go out with medium "GPU" and their KV cache group, and the offloading connector's tier moves arrive
already in the wire schema. With "include_token_ids": false (not one of vLLM's keys) BlockStored
carries an empty token id list: a subscriber learns which blocks are cached, never the text of
someone's prompt.

An optional ROUTER replay socket answers a request [start seq (8-byte big-endian)] with one [topic,
seq, payload] message per buffered batch from that seq on, then [b"", END_SEQ, b""] (vLLM 0.32's
framing). A subscriber that sees a gap in the sequence numbers asks it for the missing batches; if
the first seq replayed is past the one it asked for, the buffer no longer holds them and it must
resync.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import zmq

from kvtier.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    WireEvent,
    encode_batch,
    external_block_hash,
)
from kvtier.events.schema import MEDIUM_GPU
from kvtier.kv import events as kv_events

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_PUBLISHERS = ("null", "zmq")
_ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")
# How long start-up waits for the publisher thread to bind its sockets.
_BIND_DEADLINE_S = 10.0
_POLL_INTERVAL_S = 0.05
_CLOSE_LINGER_MS = 500


# The config's fields by type (KVEventsConfig checks each).
_BOOL_FIELDS = ("enable_kv_cache_events", "include_token_ids")
_STR_FIELDS = ("publisher", "endpoint", "replay_endpoint", "topic")
_OPTIONAL_FIELDS = ("publisher", "replay_endpoint")
_COUNT_FIELDS = ("buffer_steps", "hwm", "max_queue_size")
# ZMQ takes the high-water mark as a C int; the other counts share its bound.
_MAX_COUNT = 2**31 - 1


class KVEventsConfigError(ValueError):
    """A --kv-events-config value that cannot be used; the message names the field."""


def _require_field(ok: bool, name: str, rule: str, value: Any) -> None:
    if not ok:
        raise KVEventsConfigError(f"kv_events_config.{name} {rule}, got {value!r}")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's --kv-events-config shape. Binds 127.0.0.1 unless an endpoint says otherwise."""

    enable_kv_cache_events: bool = False
    # None: "zmq" when events are enabled (vLLM leaves it unset the same way).
    publisher: str | None = None
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = None
    # Batches kept for replay.
    buffer_steps: int = 10_000
    # ZMQ high-water mark of the PUB socket (messages queued per slow subscriber).
    hwm: int = 100_000
    # Batches waiting for the publisher thread; past it new batches are dropped and counted.
    max_queue_size: int = 100_000
    topic: str = ""
    # False: BlockStored events carry no token ids (an empty list, the layout unchanged).
    include_token_ids: bool = True

    def __post_init__(self) -> None:
        self._check_types()
        publisher = self.publisher or ("zmq" if self.enable_kv_cache_events else "null")
        object.__setattr__(self, "publisher", publisher)
        checks = [
            (publisher in _PUBLISHERS, "publisher", f"must be one of {', '.join(_PUBLISHERS)}"),
            (self.endpoint.startswith(_ENDPOINT_SCHEMES), "endpoint",
             "must start with tcp://, ipc:// or inproc://"),
            (self.replay_endpoint is None or self.replay_endpoint.startswith(_ENDPOINT_SCHEMES),
             "replay_endpoint", "must be null or start with tcp://, ipc:// or inproc://"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise KVEventsConfigError(
                    f"kv_events_config.{name} {rule}, got {getattr(self, name)!r}")

    def _check_types(self) -> None:
        """Every field's type, and the counts' range: a wrong one would otherwise surface only
        in the publisher thread (a string topic, an int high-water mark), which then dies and
        leaves subscribers waiting for events that never come."""
        for name in _BOOL_FIELDS:
            _require_field(isinstance(getattr(self, name), bool), name, "must be true or false",
                           getattr(self, name))
        for name in _STR_FIELDS:
            value = getattr(self, name)
            _require_field(isinstance(value, str) or (value is None and name in _OPTIONAL_FIELDS),
                           name, "must be a string" + (" or null" if name in _OPTIONAL_FIELDS
                                                       else ""), value)
        for name in _COUNT_FIELDS:
            value = getattr(self, name)
            _require_field(isinstance(value, int) and not isinstance(value, bool)
                           and 1 <= value <= _MAX_COUNT, name,
                           f"must be an integer in [1, {_MAX_COUNT}]", value)

    @property
    def is_publishing(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise KVEventsConfigError(f"--kv-events-config is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise KVEventsConfigError("--kv-events-config must be a JSON object")
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVEventsConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise KVEventsConfigError(f"unknown kv_events_config key(s) {', '.join(unknown)}; "
                                      f"valid keys: {', '.join(sorted(known))}")
        return cls(**data)


def to_wire_event(event: Any, include_token_ids: bool = True) -> WireEvent:
    """One engine event in the wire schema. The device cache's medium goes out as "GPU" (vLLM
    names it so on every platform; routers match on that name)."""
    if isinstance(event, kv_events.BlockStored):
        return BlockStored(
            [external_block_hash(h) for h in event.block_hashes],
            external_block_hash(event.parent_block_hash),
            list(event.token_ids) if include_token_ids else [], event.block_size,
            # kvtier names LoRA adapters rather than numbering them: the name goes as lora_name.
            None, MEDIUM_GPU, event.lora_id, group_idx=event.group_idx,
            kv_cache_spec_kind=event.kind, kv_cache_spec_sliding_window=event.sliding_window)
    if isinstance(event, kv_events.BlockRemoved):
        return BlockRemoved([external_block_hash(h) for h in event.block_hashes], MEDIUM_GPU,
                            group_idx=event.group_idx)
    if isinstance(event, kv_events.AllBlocksCleared):
        return AllBlocksCleared()
    if isinstance(event, BlockStored | BlockRemoved | AllBlocksCleared):
        return event
    raise TypeError(f"not a KV event: {type(event).__name__}")


def encode_events(ts: float, events: Iterable[Any], data_parallel_rank: int = 0,
                  include_token_ids: bool = True) -> bytes:
    """A batch payload: [ts, [events...], data_parallel_rank]."""
    return encode_batch(EventBatch(ts, [to_wire_event(e, include_token_ids) for e in events],
                                   data_parallel_rank))


class EventPublisher:
    """Takes event lists from the engine thread; the base class drops them (publisher "null")."""

    def publish(self, events: list[Any]) -> None:
        """Queue one batch; never blocks the engine thread."""

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Flush what is queued within timeout_s and release sockets."""


class ZmqEventPublisher(EventPublisher):
    """A PUB socket (and optional ROUTER replay socket) served by one thread.

    ZMQ sockets are not thread safe, so the thread creates, uses and closes them; the engine
    thread only puts batches on a queue.
    """

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.num_dropped = 0
        # Batches with an event that cannot be encoded (written by the publisher thread only).
        self.num_encode_errors = 0
        self._queue: queue.Queue[tuple[float, list[Any]]] = queue.Queue(config.max_queue_size)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._bind_error: BaseException | None = None
        self._replay_buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._thread = threading.Thread(target=self._run, name="kvtier-kv-events", daemon=True)
        self._thread.start()
        if not self._ready.wait(_BIND_DEADLINE_S):
            self._stop.set()  # the thread gives up once it binds, instead of serving nobody
            raise TimeoutError(f"KV event publisher did not bind {config.endpoint} "
                               f"within {_BIND_DEADLINE_S} s")
        if self._bind_error is not None:
            raise KVEventsConfigError(f"cannot bind kv_events_config.endpoint "
                                      f"{config.endpoint}: {self._bind_error}")

    def publish(self, events: list[Any]) -> None:
        if not events:
            return
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.num_dropped += 1

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("KV event publisher did not stop within %.1f s", timeout_s)

    def _run(self) -> None:
        context = zmq.Context.instance()
        pub = context.socket(zmq.PUB)
        replay = context.socket(zmq.ROUTER) if self.config.replay_endpoint else None
        try:
            pub.setsockopt(zmq.SNDHWM, self.config.hwm)
            pub.bind(self.config.endpoint)
            if replay is not None:
                replay.bind(self.config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._bind_error = exc
            self._ready.set()
            _close(pub, replay)
            return
        self._ready.set()
        try:
            self._serve(pub, replay)
        finally:
            _close(pub, replay)

    def _serve(self, pub: zmq.Socket, replay: zmq.Socket | None) -> None:
        topic = self.config.topic.encode()
        while not (self._stop.is_set() and self._queue.empty()):
            if replay is not None:
                self._answer_replays(replay, topic)
            try:
                ts, events = self._queue.get(timeout=_POLL_INTERVAL_S)
            except queue.Empty:
                continue
            try:
                payload = encode_events(ts, events, self.data_parallel_rank,
                                        self.config.include_token_ids)
            except Exception:
                # One bad event must not end the thread: every later batch would be lost.
                logger.exception("dropping a KV event batch that cannot be encoded")
                self.num_encode_errors += 1
                continue
            seq = self._seq.to_bytes(8, "big")
            pub.send_multipart([topic, seq, payload])
            self._replay_buffer.append((self._seq, payload))
            self._seq += 1

    def _answer_replays(self, replay: zmq.Socket, topic: bytes) -> None:
        while replay.poll(0):
            frames = replay.recv_multipart()
            client, start = frames[0], int.from_bytes(frames[-1], "big")
            for seq, payload in list(self._replay_buffer):
                if seq >= start:
                    replay.send_multipart([client, b"", topic, seq.to_bytes(8, "big"),
                                           payload])
            replay.send_multipart([client, b"", b"", END_SEQ, b""])


def _close(*sockets: zmq.Socket | None) -> None:
    for sock in sockets:
        if sock is not None:
            # A short linger lets the last batches reach subscribers at shutdown.
            sock.close(linger=_CLOSE_LINGER_MS)


def make_event_publisher(config: KVEventsConfig | None) -> EventPublisher:
    """The publisher a config asks for; no config or publisher "null": one that drops events."""
    if config is None or not config.is_publishing:
        return EventPublisher()
    return ZmqEventPublisher(config)
