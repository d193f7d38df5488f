"""Which chunk files the fs tier's directory holds, answered without a file system call on the
caller's thread.

The directory may be a network mount, and a `stat` on a mount whose server is gone blocks for
as long as the mount says (forever, on a `hard` NFS mount). Lookups come from the engine thread
while it schedules a step, so one such stat would stall every request. Here a lookup answers
from memory what this instance knows (it stored, loaded or deleted the file, or a stat answered
lately), and hands any other name to a probe thread that runs the stat. It waits at most
`_WAIT_S` for the answer (a local disk answers in tens of microseconds: the same step sees it),
and answers UNKNOWN otherwise: the scheduler asks again next step, and by then the answer is in
memory. A stat that has run for `_STUCK_S` makes the directory unavailable: until it returns,
lookups answer NOT_FOUND at once and jobs fail at once, so a hung mount costs misses, not stalls.

What memory holds is trusted for a while only (`_FOUND_S`, `_ABSENT_S`): other instances store
and delete files in the same directory. A FOUND that has turned stale costs one failed load
(the chunk is then recomputed); a stale NOT_FOUND, one recomputed chunk.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvtier.common.bounded import BoundedDict
from kvtier.common.daemon_threads import DaemonThreadPool
from kvtier.offload.tiers.base import LookupResult

logger = logging.getLogger(__name__)

# Longest a lookup waits for its stat. Through the probe thread a local file's stat answers in
# ~20-50 us, and a loaded machine may take a millisecond to run the thread (longer while other
# threads hold the GIL: they give it up every 5 ms); past that the answer comes next step
# instead (UNKNOWN), so a slow mount costs a step at most this much per lookup.
_WAIT_S = 0.002
# The waits of lookups in a row share this many seconds, refilled at _WAIT_SHARE of the time
# that passes: an 8k-token prompt's 511 chunks that this instance has never seen would cost
# ~10 ms of thread hand-offs in one step; past the first ~2 ms the rest come next step.
_WAIT_BURST_S = 0.002
_WAIT_SHARE = 0.05
# A stat running this long means the mount does not answer (its server is gone or failing
# over; a busy NFS server answers in milliseconds): the directory is unavailable until it
# returns. Until then the lookups it holds up answer UNKNOWN and their requests wait.
_STUCK_S = 1.0
# Seconds a FOUND (this instance stored or loaded the file, or a stat saw it) is trusted:
# another instance may delete the file to keep its budget.
_FOUND_S = 10.0
# Seconds a NOT_FOUND is trusted: long enough for the next step to see a stat's answer, short
# enough that a chunk another instance stores soon becomes a hit.
_ABSENT_S = 2.0
# Names whose answers are kept (~290 bytes each: 29 MB), least recently answered forgotten
# first.
_MAX_ANSWERS = 100_000
# Names waiting for a stat at most: past that a lookup answers NOT_FOUND (a flood of new
# chunks on a slow mount: a miss beats a wait).
_MAX_PENDING = 4096
# Longest the idle probe thread sleeps: a lookup or shutdown wakes it at once; this is the
# deadline of its wait should a wake-up be missed.
_IDLE_S = 0.5


class DirectoryUnavailable(TimeoutError):
    """The directory has not answered a stat for `_STUCK_S` (a hung mount)."""


class FsIndex:
    """Answers for chunk file names (`exists(name)` runs the stat, on the probe thread)."""

    def __init__(self, exists: Callable[[str], bool], thread_name: str, where: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._exists = exists
        self._where = where  # for log lines: the tier and its directory
        self._clock = clock
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # the probe thread waits for names
        self._done = threading.Condition(self._lock)  # lookups wait for answers
        # name -> (found, clock() when learnt)
        self._answers: BoundedDict[str, tuple[bool, float]] = BoundedDict(_MAX_ANSWERS)
        # Names waiting for a stat, oldest first; the one being checked stays until answered.
        self._pending: dict[str, None] = {}
        # clock() when the stat now running began; None while the probe thread is idle.
        self._probe_since: float | None = None
        self._wait_left = _WAIT_BURST_S
        self._refilled_at = clock()
        self._warned_stuck = False
        self._stopping = False
        self._prober = DaemonThreadPool(1, thread_name)
        self._prober.submit(self._probe_loop)

    def lookup(self, name: str) -> LookupResult:
        now = self._clock()
        with self._lock:
            stuck = self._is_stuck(now)
            answer = None if stuck else self._answer_or_ask(name, now)
        if stuck:
            self._warn_stuck()
            return LookupResult.NOT_FOUND
        return LookupResult.UNKNOWN if answer is None else answer

    def _answer_or_ask(self, name: str, now: float) -> LookupResult | None:
        """The answer memory holds, or the stat's if it comes within the wait; None: not yet
        (caller holds the lock)."""
        answer = self._answer(name, now)
        if answer is not None or name in self._pending:
            return answer
        if len(self._pending) >= _MAX_PENDING:
            return LookupResult.NOT_FOUND
        # Only a name the probe thread takes at once is waited for: behind others it would wait
        # for their stats too.
        wait_s = 0.0 if self._pending else self._take_wait(now)
        self._pending[name] = None
        self._work.notify()
        if wait_s <= 0:
            return None
        self._done.wait_for(lambda: name not in self._pending, wait_s)
        self._wait_left -= self._clock() - now
        return self._answer(name, self._clock())

    def remember(self, name: str, found: bool) -> None:
        """This instance has just seen whether the file `name` is there (a store or a load of
        it, a failed load, a deletion)."""
        with self._lock:
            self._answers[name] = (found, self._clock())

    def clear(self) -> None:
        """Forget every answer (the directory was removed, and its files with it)."""
        with self._lock:
            self._answers.clear()

    def check_available(self) -> None:
        """Raise DirectoryUnavailable while a stat has hung for `_STUCK_S`: a job would hang
        in the same mount."""
        with self._lock:
            stuck = self._is_stuck(self._clock())
        if stuck:
            self._warn_stuck()
            raise DirectoryUnavailable(f"{self._where} has not answered a stat for "
                                       f"{_STUCK_S:g} s (a hung mount?)")

    def shutdown(self, timeout_s: float) -> bool:
        """Stop the probe thread; False if it is stuck in a stat (abandoned: a daemon thread)."""
        with self._lock:
            self._stopping = True
            self._work.notify()
        return self._prober.shutdown(timeout_s)

    def _answer(self, name: str, now: float) -> LookupResult | None:
        """The answer memory holds for `name`, if still trusted (caller holds the lock)."""
        known = self._answers.get(name)
        if known is None:
            return None
        found, learnt = known
        if now - learnt >= (_FOUND_S if found else _ABSENT_S):
            return None
        return LookupResult.FOUND if found else LookupResult.NOT_FOUND

    def _is_stuck(self, now: float) -> bool:
        """Whether the stat now running has run `_STUCK_S` (caller holds the lock)."""
        return self._probe_since is not None and now - self._probe_since >= _STUCK_S

    def _warn_stuck(self) -> None:
        """Once per hang, outside the lock (a slow log handler must not hold up lookups)."""
        if not self._warned_stuck:
            self._warned_stuck = True
            logger.warning("fs tier %s has not answered a stat for %g s (a hung mount?); its "
                           "lookups miss and its jobs fail until it does", self._where,
                           _STUCK_S)

    def _take_wait(self, now: float) -> float:
        """Seconds this lookup may wait for its stat (see _WAIT_BURST_S)."""
        self._wait_left = min(_WAIT_BURST_S,
                              self._wait_left + (now - self._refilled_at) * _WAIT_SHARE)
        self._refilled_at = now
        return min(_WAIT_S, self._wait_left)

    # ---- the probe thread ------------------------------------------------------------------

    def _probe_loop(self) -> None:
        while (started_name := self._next_name()) is not None:
            started, name = started_name
            try:
                found = self._exists(name)  # may hang: lookups see `_probe_since` meanwhile
            except Exception:  # a stat that cannot answer is a miss
                found = False
            self._record(name, found, started)

    def _next_name(self) -> tuple[float, str] | None:
        """The oldest pending name, once there is one, and when its stat starts; None at
        shutdown."""
        with self._lock:
            while not self._pending:
                if self._stopping:
                    return None
                self._work.wait(_IDLE_S)
            if self._stopping:
                return None
            self._probe_since = self._clock()
            return self._probe_since, next(iter(self._pending))

    def _record(self, name: str, found: bool, started: float) -> None:
        with self._lock:
            self._probe_since = None
            self._pending.pop(name, None)
            known = self._answers.get(name)
            if known is None or known[1] < started:  # else a store or load since knows better
                self._answers[name] = (found, self._clock())
            took = self._clock() - started
            if took >= _STUCK_S:
                # What was asked while the mount hung is stale, and stat-ing it all could hang
                # again name by name: the lookups that still want it ask again.
                self._pending.clear()
            self._done.notify_all()
        if took >= _STUCK_S:
            self._warned_stuck = False
            logger.warning("fs tier %s: a stat took %.1f s; lookups and jobs resume",
                           self._where, took)
