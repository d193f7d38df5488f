"""Wakes the engine thread once a waiting request's promotions have all ended.

While every live request waits for chunks on their way up from a secondary tier, the engine has
nothing to compute. Stepping every half millisecond to ask again kept the GIL and a core busy
that the tiers' read threads needed: an 8k-token disk hit's reads took ~1.5x as long as alone.
Instead the engine sleeps here until every promotion one waiting request needs has ended, until
a bound passes (the next step expires late jobs), or until `interrupt` (a new command for the
engine). When some request waits on something the watch is not told of (a tier that cannot
answer yet, no free host slot), the engine polls as before.

Threads: `started`, `expect` and `wait` run on the engine thread, `ended` on the
tiers' threads (and the engine thread for an expired job), `interrupt` on any thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable


class PromotionWatch:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Event()
        # Promotion jobs submitted and not ended.
        self._in_flight: set[int] = set()
        # Per waiting request, the promotion jobs it still needs.
        self._needs: list[set[int]] = []
        # A waiting request needs something not in `_needs`: wait() polls.
        self._poll = True
        self._interrupted = False

    def started(self, job_id: int) -> None:
        with self._lock:
            self._in_flight.add(job_id)

    def ended(self, job_id: int) -> None:
        """A job ended (any job: those not started here are ignored); wakes `wait` if it was
        the last one a waiting request needed."""
        with self._lock:
            if job_id not in self._in_flight:
                return
            self._in_flight.discard(job_id)
            met = False
            for need in self._needs:
                if job_id in need:
                    need.discard(job_id)
                    met = met or not need
        if met:
            self._wake.set()

    def expect(self, needs: Iterable[Iterable[int]], poll: bool) -> None:
        """What the waiting requests need now: per request the promotion jobs it waits for
        (those ended already are dropped); `poll`: some request also waits on something else."""
        with self._lock:
            self._needs = [set(need) & self._in_flight for need in needs]
            self._poll = poll or not self._needs

    def wait(self, timeout_s: float, poll_s: float) -> None:
        """Return when a waiting request's promotions have all ended, on `interrupt`, or after
        `timeout_s`; after `poll_s` if the watch cannot tell (see `expect`)."""
        self._wake.clear()  # a set() from here on is seen by the wait below
        with self._lock:
            if self._interrupted or any(not need for need in self._needs):
                self._interrupted = False
                return
            poll = self._poll
        if poll:
            time.sleep(min(timeout_s, poll_s))
        else:
            self._wake.wait(timeout_s)
        with self._lock:
            self._interrupted = False

    def interrupt(self) -> None:
        """End the current (or the next) wait at once; safe from any thread."""
        with self._lock:
            self._interrupted = True
        self._wake.set()
