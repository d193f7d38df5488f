"""A thread pool whose threads never hold the process: daemon threads, a shutdown with a deadline.

concurrent.futures.ThreadPoolExecutor joins its threads at interpreter exit with no deadline, so
one call stuck in I/O (a hung network file system, a dead storage server) keeps the process
alive forever. This pool's threads are daemon threads and `shutdown` waits only until its
deadline; a thread still busy then is abandoned (logged once per pool) and dies with the process.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

logger = logging.getLogger(__name__)

# A work item: the future to settle, the function and its arguments. None stops one thread.
_Item = tuple[Future, Callable[..., Any], tuple[Any, ...]]


class DaemonThreadPool:
    def __init__(self, num_threads: int, name: str,
                 initializer: Callable[..., None] | None = None,
                 initargs: tuple[Any, ...] = ()) -> None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        self.name = name
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, args=(initializer, initargs),
                                          name=f"{name}_{index}", daemon=True)
                         for index in range(num_threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        if self._closed:
            raise RuntimeError(f"thread pool {self.name!r} is shut down")
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def shutdown(self, timeout_s: float, cancel_pending: bool = False) -> bool:
        """Stop taking work and wait at most `timeout_s` for the threads to end: after the
        queued calls (or, with `cancel_pending`, after the running ones only; queued futures
        are cancelled). True if every thread ended in time."""
        self._closed = True
        if cancel_pending:
            self._cancel_queued()
        for _ in self._threads:
            self._queue.put(None)
        deadline = time.monotonic() + max(0.0, timeout_s)
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        busy = sum(thread.is_alive() for thread in self._threads)
        if busy:
            logger.warning("%d thread(s) of %s still busy %.1f s into shutdown; abandoned "
                           "(daemon threads, they end with the process)", busy, self.name,
                           timeout_s)
        return not busy

    def _cancel_queued(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                item[0].cancel()

    def _work(self, initializer: Callable[..., None] | None, initargs: tuple[Any, ...]) -> None:
        if initializer is not None:
            initializer(*initargs)
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:  # the caller sees it through the future
                future.set_exception(exc)
            else:
                future.set_result(result)
