"""A producer's connections to its consumers, by address.

Connecting runs the transport's handshake on the transport's own thread: the engine step only
looks at a future, so a dead or slow consumer never holds it up. A connection that closed (the
consumer restarted, or a send past its deadline closed it) is made again on the next use. A
failed connect is kept for a back-off, doubling while the address keeps failing: transfers to
it fail at once meanwhile (their consumer computes the prompt) rather than each waiting for
its own connect to time out.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

from kvtier.transport import PeerId, TransferEngine, TransportError

_FIRST_BACKOFF_S = 1.0
_MAX_BACKOFF_S = 30.0


class PeerConnections:
    def __init__(self, transport: TransferEngine, connect_timeout_s: float) -> None:
        self._transport = transport
        self._connect_timeout_s = connect_timeout_s
        self._futures: dict[str, Future[PeerId]] = {}
        # Consecutive failed connects by address, and when the last one's back-off ends.
        self._num_failures: dict[str, int] = {}
        self._retry_at: dict[str, float] = {}

    def get(self, address: str) -> Future[PeerId]:
        """The connection to `address`: up, under way, or failed (within its back-off)."""
        future = self._futures.get(address)
        if future is None or not self._usable(address, future):
            future = self._futures[address] = self._connect(address)
        return future

    def _usable(self, address: str, future: Future[PeerId]) -> bool:
        if not future.done():
            return True
        if future.exception() is None:
            self._num_failures.pop(address, None)
            return self._transport.is_connected(future.result())
        if address not in self._retry_at:  # the first look at this failure starts its back-off
            num_failures = self._num_failures[address] = self._num_failures.get(address, 0) + 1
            self._retry_at[address] = time.monotonic() + min(
                _MAX_BACKOFF_S, _FIRST_BACKOFF_S * 2 ** (num_failures - 1))
        return time.monotonic() < self._retry_at[address]

    def _connect(self, address: str) -> Future[PeerId]:
        self._retry_at.pop(address, None)
        try:
            future = self._transport.connect_async(address, self._connect_timeout_s)
        except TransportError as exc:  # e.g. the engine is shut down
            future = Future()
            future.set_exception(exc)
        # The engine may be waiting for transfers; the layers waiting for this go out next step.
        future.add_done_callback(lambda _: self._transport.interrupt_get_finished())
        return future
