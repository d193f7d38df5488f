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
resync. A batch that is lost here (dropped because the queue was full, or that cannot be encoded)
still takes its seq, so that subscribers see the gap, find it missing from the replay, and resync.
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
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from prometheus_client import Counter

    from kvtier.engine.metrics import MetricsRegistry

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_PUBLISHERS = ("null", "zmq")
_ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")
# How long start-up waits for the publisher thread to bind its sockets.
_BIND_DEADLINE_S = 10.0
_POLL_INTERVAL_S = 0.05
_CLOSE_LINGER_MS = 500
# At most one warning about lost batches this often (per cause), with the totals so far.
_LOSS_WARNING_INTERVAL_S = 10.0
# A replay request is [empty delimiter, 8-byte start seq]. zmq checks the frames of its own
# handshake against the same limit (the peer's socket type and routing id, a few hundred bytes).
_MAX_REPLAY_FRAME_BYTES = 1024


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


class _Throttle:
    """Says when to log again: at most once per `interval_s`."""

    def __init__(self, interval_s: float) -> None:
        self._interval_s = interval_s
        self._next = 0.0

    def ready(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self._interval_s
        return True


class EventPublisher:
    """Takes event lists from the engine thread; the base class drops them (publisher "null")."""

    def publish(self, events: list[Any]) -> None:
        """Queue one batch; never blocks the engine thread."""

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Flush what is queued within timeout_s and release sockets."""

    def count_lost_in(self, metrics: MetricsRegistry) -> None:
        """Count the batches it loses from now on in `metrics` (it has none to lose)."""


class ZmqEventPublisher(EventPublisher):
    """A PUB socket (and optional ROUTER replay socket) served by one thread.

    ZMQ sockets are not thread safe, so the thread creates, uses and closes them; the engine
    thread only puts batches on a queue.
    """

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        # Batches dropped because the queue was full (written by the engine thread only), and
        # those of them not yet numbered: the next batch queued carries that count.
        self.num_dropped = 0
        self._num_dropped_unnumbered = 0
        self._drop_warnings = _Throttle(_LOSS_WARNING_INTERVAL_S)
        # Batches with an event that cannot be encoded (written by the publisher thread only).
        self.num_encode_errors = 0
        # kvtier:kv_events_lost_batches_total{cause}, once count_lost_in gave a registry.
        self._lost: Counter | None = None
        self._encode_error_warnings = _Throttle(_LOSS_WARNING_INTERVAL_S)
        # (time, events, batches dropped just before this one)
        self._queue: queue.Queue[tuple[float, list[Any], int]] = queue.Queue(
            config.max_queue_size)
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

    def count_lost_in(self, metrics: MetricsRegistry) -> None:
        """kvtier:kv_events_lost_batches_total{cause="queue_full" | "encode_error"}: batches
        never published, each a gap its subscribers resync over (those lost so far included)."""
        lost = metrics.counter("kvtier:kv_events_lost_batches", "KV event batches never "
                               "published (subscribers see a gap and resync).", ["cause"])
        lost.labels("queue_full").inc(self.num_dropped)
        lost.labels("encode_error").inc(self.num_encode_errors)
        self._lost = lost

    def publish(self, events: list[Any]) -> None:
        if not events:
            return
        try:
            self._queue.put_nowait((time.time(), events, self._num_dropped_unnumbered))
        except queue.Full:
            self._drop()
            return
        self._num_dropped_unnumbered = 0

    def _drop(self) -> None:
        self.num_dropped += 1
        self._num_dropped_unnumbered += 1
        if self._lost is not None:
            self._lost.labels("queue_full").inc()
        if self._drop_warnings.ready():
            logger.warning("KV event publisher dropped a batch (%d so far): its queue of %d "
                           "batches is full (the publisher thread falls behind); subscribers "
                           "see the gap and resync", self.num_dropped, self.config.max_queue_size)

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
                self._configure_replay(replay)
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

    def _configure_replay(self, replay: zmq.Socket) -> None:
        # zmq disconnects a client that announces a larger frame, before allocating it.
        replay.setsockopt(zmq.MAXMSGSIZE, _MAX_REPLAY_FRAME_BYTES)
        # One whole answer (every buffered batch and the END) fits in a client's queue, so it
        # is never cut short by a client that reads slower than we write. A client that asks
        # again before reading the last answer finds its queue full: that answer stops before
        # its END (EAGAIN instead of zmq's silent drop), which the client sees. The queue holds
        # at most one answer, a copy of the buffer, per client.
        replay.setsockopt(zmq.SNDHWM, min(self.config.buffer_steps + 1, _MAX_COUNT))
        replay.setsockopt(zmq.ROUTER_MANDATORY, 1)

    def _serve(self, pub: zmq.Socket, replay: zmq.Socket | None) -> None:
        """Alternate one replay answer with the live batches queued meanwhile, so that
        clients that keep asking cannot hold up the live stream (nor the stop)."""
        topic = self.config.topic.encode()
        while not (self._stop.is_set() and self._queue.empty()):
            asking = (replay is not None and not self._stop.is_set()
                      and self._answer_replay(replay, topic))
            self._publish_queued(pub, topic, wait_s=0.0 if asking else _POLL_INTERVAL_S)

    def _publish_queued(self, pub: zmq.Socket, topic: bytes, wait_s: float) -> None:
        """Publish the batches queued now, waiting up to `wait_s` for the first."""
        try:
            batch = self._queue.get(timeout=wait_s) if wait_s else self._queue.get_nowait()
        except queue.Empty:
            return
        num_more = self._queue.qsize()  # those queued now; then it is the replays' turn
        self._publish(pub, topic, *batch)
        for _ in range(num_more):
            try:
                batch = self._queue.get_nowait()
            except queue.Empty:
                return
            self._publish(pub, topic, *batch)

    def _publish(self, pub: zmq.Socket, topic: bytes, ts: float, events: list[Any],
                 num_dropped_before: int) -> None:
        self._seq += num_dropped_before  # their seqs: subscribers see the gap
        try:
            payload = encode_events(ts, events, self.data_parallel_rank,
                                    self.config.include_token_ids)
        except Exception:
            # One bad event must not end the thread: every later batch would be lost. Its seq
            # goes unsent, a gap subscribers see.
            self.num_encode_errors += 1
            if self._lost is not None:
                self._lost.labels("encode_error").inc()
            self._seq += 1
            if self._encode_error_warnings.ready():
                logger.exception("dropping a KV event batch that cannot be encoded (%d so far)",
                                 self.num_encode_errors)
            return
        pub.send_multipart([topic, self._seq.to_bytes(8, "big"), payload])
        self._replay_buffer.append((self._seq, payload))
        self._seq += 1

    def _answer_replay(self, replay: zmq.Socket, topic: bytes) -> bool:
        """Answer one replay request, if one waits; whether one did."""
        if not replay.poll(0):
            return False
        frames = replay.recv_multipart()
        if len(frames) != 3 or frames[1] or len(frames[2]) != 8:
            return True  # not [client, b"", start seq]: nothing to answer
        client, start = frames[0], int.from_bytes(frames[2], "big")
        answer = [[client, b"", topic, seq.to_bytes(8, "big"), payload]
                  for seq, payload in self._replay_buffer if seq >= start]
        try:
            for message in [*answer, [client, b"", b"", END_SEQ, b""]]:
                replay.send_multipart(message, flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # gone, or its queue is full (see _configure_replay): the END never comes
        return True


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
