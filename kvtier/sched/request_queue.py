"""Waiting queues: first come first served, or by (priority, arrival_time)."""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.kv import Request


class RequestQueue(ABC):
    """The order in which waiting requests are offered to the scheduler."""

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """A new request joins the queue."""

    @abstractmethod
    def peek_request(self) -> Request:
        """The next request to offer; IndexError when empty."""

    @abstractmethod
    def pop_request(self) -> Request:
        """Remove and return the next request; IndexError when empty."""

    @abstractmethod
    def prepend_requests(self, requests: Iterable[Request]) -> None:
        """Put requests back ahead of everything else, keeping their given order (preempted
        requests, and requests skipped this step that must keep their place)."""

    @abstractmethod
    def remove_requests(self, requests: Iterable[Request]) -> None:
        """Drop the given requests (aborts); requests not in the queue are ignored."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Requests in the order they would be offered."""

    def prepend_request(self, request: Request) -> None:
        self.prepend_requests([request])


class FCFSRequestQueue(RequestQueue):
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def peek_request(self) -> Request:
        return self._queue[0]

    def pop_request(self) -> Request:
        return self._queue.popleft()

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        # extendleft reverses its input; reversing first keeps the given order at the head.
        self._queue.extendleft(reversed(list(requests)))

    def remove_requests(self, requests: Iterable[Request]) -> None:
        doomed = {id(request) for request in requests}
        if doomed:
            self._queue = deque(r for r in self._queue if id(r) not in doomed)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue(RequestQueue):
    """Lowest `priority` value first, then earliest arrival (Request orders itself that way).

    Requests put back with `prepend_requests` simply rejoin the heap: their key already places
    them where they were.
    """

    def __init__(self) -> None:
        self._heap: list[Request] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty PriorityRequestQueue")
        return self._heap[0]

    def pop_request(self) -> Request:
        if not self._heap:
            raise IndexError("pop from an empty PriorityRequestQueue")
        return heapq.heappop(self._heap)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        for request in requests:
            heapq.heappush(self._heap, request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        doomed = {id(request) for request in requests}
        if doomed:
            self._heap = [r for r in self._heap if id(r) not in doomed]
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._heap))


_QUEUES: dict[str, type[RequestQueue]] = {
    "fcfs": FCFSRequestQueue,
    "priority": PriorityRequestQueue,
}


def create_request_queue(policy: str) -> RequestQueue:
    if policy not in _QUEUES:
        raise ValueError(f"policy must be one of {', '.join(_QUEUES)}, got {policy!r}")
    return _QUEUES[policy]()
