"""The Mooncake backend's reader thread: the only caller of Mooncake's read and status calls.

A read copies a sender's regions into a staging buffer this thread allocates and registers.
Mooncake cannot cancel a read it has started, so the staging buffer stays registered and alive
until Mooncake reports every part of the read ended, even when the receive it was for already
failed at its deadline; only then is the read handed to the I/O loop (`take_ended`), which copies
it into the caller's regions if that receive still waits for it. The I/O loop never calls
Mooncake, so a peer Mooncake is slow to reach holds up reads, never deadlines.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.transport.zmq_state import Receiving

logger = logging.getLogger(__name__)

# How often reads in flight are polled (Mooncake's status call for one part never blocks).
_POLL_S = 0.0005
# How often an idle reader looks whether it was stopped.
_IDLE_S = 0.1


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
    """One thread that submits reads to a Mooncake transfer engine and polls them to the end."""

    def __init__(self, mooncake: Any, on_ended: Callable[[], None]) -> None:
        self._mooncake = mooncake
        self._on_ended = on_ended
        self._todo: queue.SimpleQueue[Read] = queue.SimpleQueue()
        self._ended: deque[Read] = deque()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-mooncake-reader",
                                        daemon=True)
        self._thread.start()

    def start(self, read: Read) -> None:
        self._todo.put(read)

    def take_ended(self) -> list[Read]:
        """Reads Mooncake is done with since the last call, failed ones too."""
        return [self._ended.popleft() for _ in range(len(self._ended))]

    def stop(self) -> None:
        """Submit no more reads; the thread ends once those in flight ended (it cannot end them
        sooner: Mooncake would write into freed memory)."""
        self._stopping.set()

    def _run(self) -> None:
        active: list[Read] = []
        while active or not self._stopping.is_set():
            for read in self._take_todo(timeout_s=_POLL_S if active else _IDLE_S):
                if not self._stopping.is_set():  # never submitted: nothing for Mooncake to end
                    self._submit(read)
                    active.append(read)
            try:
                active = [read for read in active if not self._ended_now(read)]
            except Exception:
                # A bug must not leave reads unfinished for ever: their receives fail at
                # their deadlines, and this thread keeps polling the others.
                logger.exception("transport: polling Mooncake reads failed")
        self._mooncake = None  # the last reference: Mooncake's listeners close with it

    def _take_todo(self, timeout_s: float) -> list[Read]:
        """Every read queued, waiting up to `timeout_s` for the first (the poll interval)."""
        try:
            reads = [self._todo.get(timeout=timeout_s)]
        except queue.Empty:
            return []
        while not self._todo.empty():
            reads.append(self._todo.get_nowait())
        return reads

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
        self._on_ended()
        return True
