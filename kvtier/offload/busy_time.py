"""Wall-clock time during which at least one transfer was running, per direction.

Transfers overlap: a tier runs several jobs on its thread pool, and summing their durations
counts shared seconds once per job, so bytes / summed seconds understates throughput by up to
the pool size. Counting the union of the transfers' time intervals instead makes
bytes / busy seconds the throughput the direction actually delivered while it was moving data.
Intervals can be reported out of order (jobs end out of order and are collected later), so
recent ones are kept, merged, for later overlapping reports.
"""

from __future__ import annotations

import bisect

# Intervals that ended longer ago than this before the latest one are forgotten: a transfer
# reported later still that overlaps them is counted in full (slightly under-stating throughput).
_HORIZON_S = 600.0
# Bound on the intervals kept; the oldest are forgotten first.
_MAX_INTERVALS = 4096


class BusyTime:
    def __init__(self) -> None:
        self.seconds = 0.0
        # Disjoint [start, end] intervals, sorted by start.
        self._starts: list[float] = []
        self._ends: list[float] = []

    def add(self, start: float, end: float) -> float:
        """Count the interval [start, end]; returns the seconds it added (those not already
        covered by an earlier interval)."""
        if end <= start:
            return 0.0
        # Disjoint intervals sorted by start have sorted ends too.
        lo = bisect.bisect_left(self._ends, start)  # first interval that may overlap
        hi = bisect.bisect_right(self._starts, end)  # past the last one that may overlap
        covered = sum(min(e, end) - max(s, start)
                      for s, e in zip(self._starts[lo:hi], self._ends[lo:hi]))
        added = (end - start) - covered
        merged_start = min(start, self._starts[lo]) if lo < hi else start
        merged_end = max(end, self._ends[hi - 1]) if lo < hi else end
        self._starts[lo:hi] = [merged_start]
        self._ends[lo:hi] = [merged_end]
        self._forget_old()
        self.seconds += added
        return added

    def add_all(self, intervals: list[tuple[float, float]]) -> float:
        """Count several intervals (a step's transfers, overlapping on a tier's threads) at
        once: merged among themselves first, so ~500 promotions are one or two merges here;
        returns the seconds they added."""
        merged: list[tuple[float, float]] = []
        for start, end in sorted(intervals):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
            else:
                merged.append((start, end))
        return sum(self.add(start, end) for start, end in merged)

    def _forget_old(self) -> None:
        cutoff = bisect.bisect_left(self._ends, self._ends[-1] - _HORIZON_S)
        cutoff = max(cutoff, len(self._ends) - _MAX_INTERVALS)
        if cutoff > 0:
            del self._starts[:cutoff], self._ends[:cutoff]
