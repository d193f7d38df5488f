"""Counts a connector's worker half keeps: per-step stats for `KVConnectorOutput.stats` and, when
the engine has a metrics registry, Prometheus counters of the same names."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any


class ConnectorCounters:
    """`add("blocks_loaded", 3)` counts stat `<prefix>_blocks_loaded` and, for a name in
    `names`, counter `kvtier:<prefix>_blocks_loaded`; `take()` hands the stats over and resets
    them (the counters keep counting)."""

    def __init__(self, prefix: str, label: str, names: Iterable[str], metrics: Any) -> None:
        self._prefix = prefix
        self._stats: Counter[str] = Counter()
        self._counters = {} if metrics is None else {
            name: metrics.counter(f"kvtier:{prefix}_{name}", f"{label} {name.replace('_', ' ')}")
            for name in names}

    def add(self, name: str, amount: int = 1) -> None:
        if amount:
            self._stats[f"{self._prefix}_{name}"] += amount
            if name in self._counters:
                self._counters[name].inc(amount)

    def take(self) -> dict[str, float]:
        stats, self._stats = dict(self._stats), Counter()
        return stats
