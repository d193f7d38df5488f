"""Follows one instance's KV events into the index, detecting gaps and filling them by replay.

The PUB socket numbers its batches. The first batch received (the router started, or the
instance restarted) has the replay socket send everything it still buffers from seq 0, so the
index starts with what the instance cached before. Later, a batch whose seq skips ahead asks
for the missing ones; if the replay buffer no longer holds them all (its first batch is past the
one asked for, or one in between is missing: a batch the publisher lost) or does not answer in
time, the instance's entries are dropped (resync): the index never keeps blocks whose removal
it may have missed. A seq that goes backwards is a restarted publisher: its old entries are
dropped too. A batch that cannot be decoded is logged and skipped; nothing a publisher sends
ends the subscription.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from urllib.parse import urlsplit

import zmq
import zmq.asyncio

from kvtier.events import EventBatch, EventDecodeError, decode_batch

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
REPLAY_TIMEOUT_MS = 2000


def instance_endpoint(endpoint: str, instance_url: str) -> str:
    """`endpoint` as reachable from here: a wildcard bind address becomes the instance's host."""
    scheme, _, rest = endpoint.partition("://")
    host, sep, port = rest.rpartition(":")
    if scheme == "tcp" and sep and host in ("*", "0.0.0.0", "[::]", "::"):
        return f"tcp://{urlsplit(instance_url).hostname}:{port}"
    return endpoint


class EventSubscriber:
    """`apply(batch)` gets every batch in order; `reset(outcome)` is called when the entries
    built so far can no longer be trusted ("lost": a gap replay could not fill; "restarted")."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: str,
                 apply: Callable[[EventBatch], None], reset: Callable[[str], None],
                 on_gap: Callable[[str], None]) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self._apply = apply
        self._reset = reset
        self._on_gap = on_gap
        self.next_seq: int | None = None

    async def run(self) -> None:
        """Receive until cancelled."""
        context = zmq.asyncio.Context.instance()
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        try:
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    continue
                seq = int.from_bytes(frames[1], "big")
                try:
                    await self.receive(seq, frames[2])
                except Exception:
                    # A bug costs this batch and the entries built so far, never the
                    # subscription: the index would stop following the instance for good.
                    logger.exception("failed to apply KV event batch %d from %s; resyncing",
                                     seq, self.endpoint)
                    self._reset("lost")
                    self.next_seq = seq + 1
        finally:
            sub.close(linger=0)

    async def receive(self, seq: int, payload: bytes) -> None:
        """One message off the PUB socket: fill any gap before it, then apply it."""
        expected = self.next_seq
        if expected is not None and seq < expected:
            self._reset("restarted")
            expected = None
        if expected is None and seq > 0:
            await self._replay(0, seq, first=True)
        elif expected is not None and seq > expected:
            self._on_gap("detected")
            await self._replay(expected, seq, first=False)
        self._decode_and_apply(payload)
        self.next_seq = seq + 1

    async def _replay(self, start: int, end: int, first: bool) -> None:
        """Apply batches [start, end) from the replay socket; reset when they are not all there
        (on the first batch, missing ones only mean that history is not known: the batches
        after the last one missing are applied)."""
        batches = await self._fetch(start) if self.replay_endpoint else None
        run = _run_before(batches or [], end)
        if not first and (not run or run[0][0] != start):
            self._on_gap("lost")
            self._reset("lost")
            return
        for _, payload in run:
            self._decode_and_apply(payload)
        if not first:
            self._on_gap("replayed")

    async def _fetch(self, start: int) -> list[tuple[int, bytes]] | None:
        """The buffered batches from `start` on, or None if the replay socket did not answer."""
        socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        socket.connect(self.replay_endpoint)
        batches: list[tuple[int, bytes]] = []
        try:
            await socket.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await socket.poll(REPLAY_TIMEOUT_MS):
                    return None
                frames = await socket.recv_multipart()
                if len(frames) < 2:
                    return None  # not the replay framing: as good as no answer
                if frames[-2] == END_SEQ:
                    return batches
                batches.append((int.from_bytes(frames[-2], "big"), frames[-1]))
        finally:
            socket.close(linger=0)

    def _decode_and_apply(self, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except EventDecodeError as exc:
            logger.warning("skipping a KV event batch from %s: %s", self.endpoint, exc)
            return
        self._apply(batch)


def _run_before(batches: list[tuple[int, bytes]], end: int) -> list[tuple[int, bytes]]:
    """The batches of consecutive seqs that end just before `end`, in order (none when the one
    just before `end` is missing)."""
    run: list[tuple[int, bytes]] = []
    for seq, payload in reversed([batch for batch in batches if batch[0] < end]):
        if seq != end - 1 - len(run):
            break
        run.append((seq, payload))
    return run[::-1]
