"""The offload tiers on simulated time: which chunk is where, by the engine's own bookkeeping.

The tiering manager (kvtier.offload.manager) cannot run without its host area (a buffer of the
full host budget, populated at start-up) and real tier objects (a preallocated disk file), so the
planner drives the layer that manager is built on: one `HostCache` per tier with the eviction
policy the engine would use (`eviction_policy` for host memory; LRU for the disk and fs tiers,
as their own indexes are), over a slot count instead of a buffer. The manager's rules are
followed: stores only once a chunk was used `store_threshold` times, write-through tiers get a
chunk when host memory does (from its `admit_after_hits`-th host load, if set), write-back tiers
when host memory evicts it, and a chunk found on a secondary tier is promoted into host memory
before it is loaded, but for one the disk tier loads straight from its mapped file
(`direct_loads`, without a chunk secret), which is not stored into host memory either where
every tier holds it so: the engine does that when the chunk's pages are in the page cache,
which the plan takes them to be (what a plan cannot see: the page cache of a disk tier larger
than memory).
Transfers are instantaneous here; their time is the cost model's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass

from kvtier.offload.config import OffloadConfig, TierSpec
from kvtier.offload.host_area import SlotId
from kvtier.offload.host_cache import HostCache
from kvtier.offload.policies import make_policy
from kvtier.offload.tiers.disk import FILE_HEADER_BYTES, slot_stride

HOST = "host"
# HostCache lists every free slot (about 40 bytes each): past this many a huge tier size would
# allocate gigabytes before the first request. 16M slots take about 0.6 GiB and a second.
MAX_SIMULATED_SLOTS = 1 << 24


class SlotCount:
    """What a HostCache reads of its HostArea: the number of slots (no bytes behind them)."""

    def __init__(self, num_slots: int, slot_bytes: int) -> None:
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes

    def slot_view(self, slot: SlotId, num_bytes: int | None = None) -> memoryview:
        raise RuntimeError("a planned tier holds no bytes")


@dataclass
class SimTier:
    """One tier: its label (as the engine's metrics name it), kind and chunk cache."""

    name: str
    kind: str
    cache: HostCache | None  # None: no byte budget, nothing is ever evicted
    capacity_bytes: int | None
    write_back: bool = False
    admit_after_hits: int = 0
    # Loads its chunks into the device straight from a mapped file: no promotion into host.
    maps: bool = False


class SimulatedOffload:
    """Host memory and the secondary tiers of one OffloadConfig, for chunks of `chunk_bytes`."""

    def __init__(self, config: OffloadConfig, chunk_bytes: int) -> None:
        self.config = config
        self.chunk_bytes = chunk_bytes
        self.host = _tier(HOST, HOST, config.cpu_bytes_to_use, chunk_bytes, config.eviction_policy,
                          chunk_bytes)
        self.tiers = [self._secondary(spec) for spec in config.secondary_tiers]
        self._unbounded: list[set[Hashable]] = [set() for _ in self.tiers]
        self._uses: Counter[Hashable] = Counter()
        self._hits: Counter[Hashable] = Counter()
        # Chunks stored to each tier (all_tiers' order): from the device into host memory, and
        # from host memory on to a secondary tier. Promotions are loads, not counted here.
        self.num_stored = [0] * (1 + len(self.tiers))

    def _secondary(self, spec: TierSpec) -> SimTier:
        budget = _budget_bytes(spec)
        write_back = (spec.write_policy or self.config.write_policy) == "write_back"
        if budget is None:
            return SimTier(spec.name, spec.type, None, None, write_back, spec.admit_after_hits)
        tier = _tier(spec.name, spec.type, budget, _slot_bytes(spec.type, self.chunk_bytes),
                     "lru", self.chunk_bytes)
        tier.write_back, tier.admit_after_hits = write_back, spec.admit_after_hits
        # Under a chunk secret every load checks the chunk's MAC: the engine maps nothing.
        tier.maps = getattr(spec.options, "direct_loads", False) and not self.config.secret_file
        return tier

    @property
    def all_tiers(self) -> list[SimTier]:
        return [self.host, *self.tiers]

    def find(self, key: Hashable) -> int | None:
        """Where `key` is: 0 for host memory, i + 1 for secondary tier i, None nowhere."""
        if self.host.cache.is_ready(key):
            return 0
        for index, tier in enumerate(self.tiers):
            if self._has(index, tier, key):
                return index + 1
        return None

    def _has(self, index: int, tier: SimTier, key: Hashable) -> bool:
        return key in self._unbounded[index] if tier.cache is None else tier.cache.is_ready(key)

    def pin(self, found: list[tuple[Hashable, int]]) -> list[tuple[Hashable, int]]:
        """Hold the chunks a request found (key, level from find) in host memory for loading,
        promoting those from secondary tiers; returns the leading ones that made it (a
        promotion finds no slot when every host slot is held)."""
        host = self.host.cache
        for key, level in found:
            if level == 0:
                host.prepare_load(key, count_use=False)
        pinned = []
        for key, level in found:
            if level > 0 and self.tiers[level - 1].maps:
                self.tiers[level - 1].cache.prepare_load(key)  # pinned in the file
            elif level > 0 and not self._promote(key, level):
                break
            elif level > 0:
                host.prepare_load(key, count_use=False)
            pinned.append((key, level))
        for key, level in found[len(pinned):]:
            if level == 0:
                host.complete_load(key)
        return pinned

    def _promote(self, key: Hashable, level: int) -> bool:
        tier = self.tiers[level - 1]
        if tier.cache is not None:
            tier.cache.prepare_load(key)
            tier.cache.complete_load(key)
        return self._put_in_host(key)

    def release(self, pinned: list[tuple[Hashable, int]], loaded: bool) -> None:
        """End the loads of pinned chunks; `loaded`: the request used them (a host hit each,
        which may admit them to write-through tiers with admit_after_hits)."""
        host = self.host.cache
        for key, level in pinned:
            if level > 0 and self.tiers[level - 1].maps:
                self.tiers[level - 1].cache.complete_load(key)  # no host hit
                continue
            host.complete_load(key)
            if not loaded:
                continue
            host.policy.touch(key)
            self._hits[key] += 1
            for index, tier in enumerate(self.tiers):
                if not tier.write_back and tier.admit_after_hits == self._hits[key] > 0:
                    self._store_on(index, key)

    def record_use(self, key: Hashable) -> None:
        """A request contains `key` (counts towards store_threshold)."""
        if self.config.store_threshold > 1:  # a threshold of 1 is met by the request itself
            self._uses[key] += 1

    def store(self, key: Hashable) -> None:
        """The device computed `key`: into host memory (once used often enough, and unless every
        tier holds it in a file it loads from mapped), and on to the write-through tiers that
        admit it."""
        threshold = self.config.store_threshold
        if threshold > 1 and self._uses[key] < threshold:
            return
        if self.tiers and not self.host.cache.is_ready(key) and all(
                tier.maps and self._has(index, tier, key) for index, tier in enumerate(self.tiers)):
            return
        if not self._put_in_host(key):
            return
        self.num_stored[0] += 1
        for index, tier in enumerate(self.tiers):
            if not tier.write_back and self._hits[key] >= tier.admit_after_hits:
                self._store_on(index, key)

    def _put_in_host(self, key: Hashable) -> bool:
        cache = self.host.cache
        if cache.prepare_store(key, self.chunk_bytes) is None:
            return False  # already there, or every slot is held by a load
        cache.complete_store(key, ok=True)
        for victim in cache.take_evicted():
            for index, tier in enumerate(self.tiers):
                if tier.write_back and self._hits[victim] >= tier.admit_after_hits:
                    self._store_on(index, victim)
        return True

    def _store_on(self, index: int, key: Hashable) -> None:
        tier = self.tiers[index]
        if tier.cache is None:
            if key in self._unbounded[index]:
                return
            self._unbounded[index].add(key)
        elif tier.cache.is_ready(key):
            tier.cache.policy.touch(key)  # the disk tier's index: a rewrite is a recent use
            return  # and no write (the tier finds the chunk there)
        elif tier.cache.prepare_store(key, self.chunk_bytes) is not None:
            tier.cache.complete_store(key, ok=True)
            tier.cache.take_evicted()
        else:
            return
        self.num_stored[1 + index] += 1


def check_tier_sizes(config: OffloadConfig, chunk_bytes: int) -> None:
    """ValueError naming --kv-offload when a tier of `config` holds no chunk of
    `chunk_bytes`, or more than the planner simulates: before any work, where SimulatedOffload
    would fail only once the trace is read."""
    _num_slots(HOST, config.cpu_bytes_to_use, chunk_bytes)
    for spec in config.secondary_tiers:
        budget = _budget_bytes(spec)
        if budget is not None:
            _num_slots(spec.name, budget, _slot_bytes(spec.type, chunk_bytes))


def _budget_bytes(spec: TierSpec) -> int | None:
    """The bytes a secondary tier's slots may take; None: no byte budget."""
    max_bytes = getattr(spec.options, "max_bytes", None)
    # The disk tier's file starts with a page of header, then its slots.
    if max_bytes is not None and spec.type == "disk":
        return max_bytes - FILE_HEADER_BYTES
    return max_bytes


def _slot_bytes(kind: str, chunk_bytes: int) -> int:
    return slot_stride(chunk_bytes) if kind == "disk" else chunk_bytes


def _num_slots(name: str, budget_bytes: int, slot_bytes: int) -> int:
    num_slots = budget_bytes // slot_bytes
    if num_slots < 1:
        raise ValueError(f"--kv-offload: the {name} tier's {budget_bytes} bytes hold no chunk "
                         f"of {slot_bytes} bytes; give it at least {slot_bytes}")
    if num_slots > MAX_SIMULATED_SLOTS:
        limit = MAX_SIMULATED_SLOTS * slot_bytes
        raise ValueError(f"--kv-offload: the {name} tier's {budget_bytes} bytes hold "
                         f"{num_slots} chunks of {slot_bytes} bytes; the planner simulates at "
                         f"most {MAX_SIMULATED_SLOTS}, so give it at most {limit} bytes "
                         f"({limit / 2**30:.1f} GiB)")
    return num_slots


def _tier(name: str, kind: str, budget_bytes: int, slot_bytes: int, policy: str,
          chunk_bytes: int) -> SimTier:
    """A tier of `budget_bytes` in slots of `slot_bytes`; its capacity counts the KV bytes its
    slots hold (`chunk_bytes` each), comparable with the working set."""
    num_slots = _num_slots(name, budget_bytes, slot_bytes)
    cache = HostCache(SlotCount(num_slots, slot_bytes), make_policy(policy, num_slots))
    return SimTier(name, kind, cache, num_slots * chunk_bytes)
