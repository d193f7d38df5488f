"""The Mooncake backend's reader: the only caller of Mooncake's read and status calls.

A read copies a sender's regions into a staging buffer the reader allocates and registers.
Mooncake cannot cancel a read it has started, so the staging buffer stays registered and alive
until Mooncake reports every part of the read ended, even when the receive it was for already
failed at its deadline; only then is the read handed to the I/O loop (`take_ended`), which copies
it into the caller's regions if that receive still waits for it.

Threads: one per sender session submits that sender's reads, and one polls every read in
flight. Mooncake's first contact with a session blocks up to a minute on a peer that accepts the
connection and stays silent; the probe each session's thread sends first keeps that to the
thread of the silent sender. The I/O loop never calls Mooncake, so nothing here holds up a
deadline.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.transport.zmq_state import Receiving

logger = logging.getLogger(__name__)

# How often reads in flight are polled (Mooncake's status call for one part never blocks).
_POLL_S = 0.0005
# How often idle threads look whether they were stopped.
_IDLE_S = 0.1
# A session's submitting thread ends after this long without reads.
_SESSION_IDLE_S = 2.0


def address_of(view: memoryview) -> int:
    """The address of a C-contiguous buffer's first byte (read-only buffers too)."""
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


@dataclass
class Read:
    """Pull `sizes` bytes at `addrs` of the Mooncake `session` for `receiving`, in that order."""

    receiving: Receiving
    session: str
    addrs: list[int]
    sizes: list[int]
    staging: bytearray = field(default_factory=bytearray)
    # Mooncake batch ids of the parts still in flight (one region each).
    batches: list[int] = field(default_factory=list)
    error: str | None = None


class Reader:
    """Submits reads to a Mooncake transfer engine and polls them to the end."""

    def __init__(self, mooncake: Any, on_ended: Callable[[], None]) -> None:
        self._mooncake = mooncake
        # Weak: the engine owns this reader, and a cycle back to it would leave Mooncake's
        # engine to the garbage collector, at a random moment; destroying one holds the GIL
        # for most of a second, stopping every thread of the process.
        self._on_ended = weakref.WeakMethod(on_ended)
        self._lock = threading.Lock()
        # Sessions with a submitting thread, and the reads queued for it.
        self._sessions: dict[str, queue.SimpleQueue[Read]] = {}
        self._submitted: queue.SimpleQueue[Read] = queue.SimpleQueue()
        self._ended: deque[Read] = deque()
        self._stopping = threading.Event()
        self._poller = threading.Thread(target=self._poll_all, name="kvtier-mooncake-poll",
                                        daemon=True)
        self._poller.start()

    def start(self, read: Read) -> None:
        with self._lock:
            todo = self._sessions.get(read.session)
            if todo is None:
                todo = self._sessions[read.session] = queue.SimpleQueue()
                threading.Thread(target=self._submit_all, args=(read.session, todo),
                                 name="kvtier-mooncake-submit", daemon=True).start()
            todo.put(read)

    def take_ended(self) -> list[Read]:
        """Reads Mooncake is done with since the last call, failed ones too."""
        return [self._ended.popleft() for _ in range(len(self._ended))]

    def stop(self, timeout_s: float) -> None:
        """Submit no more reads, and wait up to `timeout_s` for the threads to end. They end
        once the reads in flight ended (not sooner: Mooncake would write into freed memory)."""
        self._stopping.set()
        self._poller.join(timeout_s)

    def _submit_all(self, session: str, todo: queue.SimpleQueue[Read]) -> None:
        # Mooncake opens a new session under a lock every read takes, so a session must answer
        # a probe (which takes no such lock) before its first read: one whose sender is silent
        # blocks this thread, not the others.
        reachable: bool | None = None
        idle_since = time.monotonic()
        while True:
            try:
                read = todo.get(timeout=_IDLE_S)
            except queue.Empty:
                if self._stopping.is_set() or time.monotonic() - idle_since >= _SESSION_IDLE_S:
                    with self._lock:  # `start` queues under this lock: nothing slips in after
                        if todo.empty():
                            del self._sessions[session]
                            return
                continue
            idle_since = time.monotonic()
            if not self._stopping.is_set():  # else never submitted: nothing for Mooncake to end
                try:
                    if reachable is None:
                        reachable = self._mooncake.send_probe(session) == 0
                    if reachable:
                        self._submit(read)
                    else:
                        read.error = f"Mooncake cannot reach the sender at {session}"
                except Exception:
                    # A bug costs this read (it fails), never the session's thread.
                    logger.exception("transport: submitting a Mooncake read failed")
                    read.error = read.error or "internal error submitting the Mooncake read"
                self._submitted.put(read)

    def _poll_all(self) -> None:
        active: list[Read] = []
        while True:
            try:
                active.append(self._submitted.get(timeout=_POLL_S if active else _IDLE_S))
                while not self._submitted.empty():
                    active.append(self._submitted.get_nowait())
            except queue.Empty:
                pass
            try:
                active = [read for read in active if not self._ended_now(read)]
            except Exception:
                # A bug must not leave reads unfinished for ever: their receives fail at
                # their deadlines, and this thread keeps polling the others.
                logger.exception("transport: polling Mooncake reads failed")
            with self._lock:
                submitting = bool(self._sessions)
            if self._stopping.is_set() and not active and not submitting:
                return

    def _submit(self, read: Read) -> None:
        read.staging = bytearray(sum(read.sizes))
        base = address_of(memoryview(read.staging))
        if self._mooncake.register_memory(base, len(read.staging)) != 0:
            read.error = "Mooncake could not register the receive's staging memory"
            read.staging = bytearray()  # nothing to unregister
            return
        offset = 0
        for addr, size in zip(read.addrs, read.sizes):
            if size:
                batch = self._mooncake.batch_transfer_async_read(read.session, [base + offset],
                                                                 [addr], [size])
                if batch == 0:  # Mooncake's "not submitted"
                    read.error = f"Mooncake could not read from the sender at {read.session}"
                    return
                read.batches.append(batch)
            offset += size

    def _ended_now(self, read: Read) -> bool:
        in_flight = []
        for batch in read.batches:
            # 0 in flight, 1 completed, -1 failed, -2 timed out (each batch has one part).
            status = self._mooncake.transfer_check_status(batch)
            if status == 0:
                in_flight.append(batch)
            elif status < 0 and read.error is None:
                read.error = (f"Mooncake's read from {read.session} "
                              f"{'failed' if status == -1 else 'timed out'}")
        read.batches = in_flight
        if in_flight:
            return False
        if read.staging:
            self._mooncake.unregister_memory(address_of(memoryview(read.staging)))
        self._ended.append(read)
        wake = self._on_ended()
        if wake is not None:
            wake()
        return True
