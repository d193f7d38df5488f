"""The tiering manager: the host tier in front of the secondary tiers.

Host-centric: every chunk enters through the host area and, but for the loads straight from a
mapped file below, leaves through it. A chunk from the device is pushed to the secondary tiers
(the cascade), each by its own policies (TierSpec): a write_through tier gets it as soon as its
device->host store completes; a write_back tier only once the host tier runs short of clean
slots (the oldest dirty chunks first) or at shutdown (write_back.py). A tier with
`admit_after_hits` N takes a chunk only once it has been loaded from host memory N times (a
write_through tier at that N-th load), and a tier with `max_pending_stores` stores in flight
gets no new store: it is dropped and counted, so a slow tier never holds host slots. A chunk the
device stores again (recomputed) skips the tiers known to hold it (TierQueries).
A lookup that misses the host asks the secondary tiers in order; the first that has the chunk
promotes it into the host asynchronously and the answer is RETRY, so the scheduler asks again
next step instead of waiting; a tier that can hand the chunk over from a file mapped into the
process (checked, and in memory: the disk tier) answers MAPPED instead, and the chunk is loaded
into the device from there in the step that admits the request, with no promotion. Everything
here runs on the engine thread; tiers do their I/O on their own threads and report through
`get_finished_jobs`, drained by `poll`, and a tier built on ThreadedTier also tells the
promotion watch as each job ends (`TierContext.on_job_end`), so an engine with nothing else to
do sleeps until a waiting request's promotions are in.

Failures never propagate: a tier that raises, reports a failed job or misses its deadline costs a
counted error, and a chunk that failed to come back from a tier is not asked of that tier again
(until a later store to it succeeds), so the request recomputes instead.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from kvtier.common.bounded import BoundedDict
from kvtier.offload.chunk_format import load_chunk_secret
from kvtier.offload.config import OffloadConfig
from kvtier.offload.events import DEVICE, HOST, TierMoveEvent
from kvtier.offload.host_area import HostArea, SlotId
from kvtier.offload.host_cache import HostCache
from kvtier.offload.keys import ChunkKey
from kvtier.offload.metrics import OffloadMetrics
from kvtier.offload.policies import make_policy
from kvtier.offload.promotion_watch import PromotionWatch
from kvtier.offload.tier_queries import TierQueries
from kvtier.offload.tiers.base import (
    JobResult,
    LookupResult,
    SecondaryTier,
    TierContext,
    TransferJob,
)
from kvtier.offload.tiers.registry import create_tiers
from kvtier.offload.write_back import WriteBack

# How often `flush` polls the tiers.
_FLUSH_POLL_S = 0.002


class Lookup(enum.Enum):
    HIT = "hit"  # in host memory now
    # Checked and in memory in a tier's mapped file: loaded from there now (no promotion)
    MAPPED = "mapped"
    MISS = "miss"
    RETRY = "retry"  # on its way into host memory; ask again next step


@dataclass
class _TierJob:
    kind: Literal["promote", "cascade"]
    tier: int
    key: ChunkKey
    num_bytes: int
    started: float
    expired: bool = False


class TieringManager:
    def __init__(self, config: OffloadConfig, namespace: bytes, area: HostArea,
                 metrics_registry: Any = None,
                 clock: Callable[[], float] = time.monotonic,
                 description: Mapping[str, Any] | None = None,
                 watch: PromotionWatch | None = None) -> None:
        """`area`: the host memory this tier manages (its slots fit the largest chunk of any KV
        cache group); whoever copies chunks in and out of it (the connector's worker half)
        holds the same area. `description`: what `namespace` covers, handed to the tiers
        (TierContext). `watch`: told when promotions start and end (default: one of its own)."""
        self.config = config
        self.area = area
        self.host = HostCache(self.area, make_policy(config.eviction_policy, self.area.num_slots))
        self.metrics = OffloadMetrics(metrics_registry)
        secret = load_chunk_secret(config.secret_file) if config.secondary_tiers else None
        self.watch = PromotionWatch() if watch is None else watch
        self.tiers: list[SecondaryTier] = create_tiers(
            config.secondary_tiers,
            lambda spec: TierContext(spec.name, namespace, metrics_registry, self.area.slot_bytes,
                                     description, secret, self.host, on_job_end=self.watch.ended))
        self.tier_names = [tier.context.name for tier in self.tiers]
        self._tier_write_back = [(spec.write_policy or config.write_policy) == "write_back"
                                 for spec in config.secondary_tiers]
        self._pending_stores = [0] * len(self.tiers)
        self._clock = clock
        self._job_ids = itertools.count()
        self._jobs: dict[int, _TierJob] = {}
        # (deadline, job id) in submission order: every job gets the same timeout, so the
        # deadlines come in order and each step checks only the ones that have passed.
        self._deadlines: deque[tuple[float, int]] = deque()
        self._promoting: dict[ChunkKey, int] = {}
        # Inside `promotions()`: the loads its lookups started, per tier, not yet submitted.
        self._held_loads: dict[int, list[TransferJob]] | None = None
        remembered = 16 * self.area.num_slots  # chunks each of these remembers at most
        self.queries = TierQueries(self.tiers, self.metrics, clock, remembered)
        # Requests seen per chunk, for store_threshold.
        self._uses: BoundedDict[ChunkKey, int] = BoundedDict(remembered)
        # Loads from host memory into the device per chunk, for admit_after_hits (counted
        # only where a tier sets it).
        self._hits: BoundedDict[ChunkKey, int] = BoundedDict(remembered)
        self._counts_hits = any(spec.admit_after_hits for spec in config.secondary_tiers)
        self._events: list[TierMoveEvent] = []
        self._write_back = any(self._tier_write_back)
        self.write_back = WriteBack(
            self.host, self.area.num_slots,
            lambda key: not any(map(self._at_limit, self._targets(key, write_back=True))),
            lambda key: [self._store_on(index, key)
                         for index in self._targets(key, write_back=True)])

    # ---- lookup and promotion -------------------------------------------------------------

    def lookup(self, key: ChunkKey, num_bytes: int, req_context: Any = None,
               record: bool = True) -> Lookup:
        """Where `key` is; `record=False` leaves the hit/query counters alone (the caller asked
        about this chunk before: a retry while it is promoted)."""
        if self.host.is_ready(key):
            if record:
                self.metrics.lookup(HOST, True)
            return Lookup.HIT
        if record:
            self.metrics.lookup(HOST, False)
        if key in self._promoting:
            return Lookup.RETRY
        if key in self.host.entries:
            return Lookup.MISS  # arriving from the device; its blocks are still there
        for index in range(len(self.tiers)):
            answer = self.queries.ask(index, key, req_context, record)
            if answer is LookupResult.UNKNOWN:
                return Lookup.RETRY
            if answer is LookupResult.FOUND:
                if self.queries.num_mappable(index, [key], num_bytes):
                    return Lookup.MAPPED
                # Promoting, or every host slot is busy for now: ask again later (a MISS would
                # recompute what the tier holds). A failed submit marks the tier failed for
                # this key, so the next ask goes on to the tiers below.
                self._promote(index, key, num_bytes)
                return Lookup.RETRY
        return Lookup.MISS

    @contextmanager
    def promotions(self) -> Iterator[None]:
        """Lookups inside (not nested) start their promotions together, handed to each tier at
        once on exit (`submit_loads`): one by one, an 8k-token prompt's 511 chunks on disk cost
        the engine thread ~4 ms, and the read threads as much."""
        self._held_loads = defaultdict(list)
        try:
            yield
        finally:
            held, self._held_loads = self._held_loads, None
            for index, jobs in held.items():
                self._submit_loads(index, jobs)

    def is_promoting(self, key: ChunkKey) -> bool:
        """`key` is on its way up from a secondary tier (a lookup would answer RETRY)."""
        return key in self._promoting

    def promotion_jobs(self, keys: list[ChunkKey]) -> list[int] | None:
        """The jobs promoting those of `keys` still on their way up, or None if one comes from
        a tier that does not report its jobs' ends (then only polling sees it arrive)."""
        jobs = []
        for key in keys:
            job_id = self._promoting.get(key)
            if job_id is not None:
                if not self.tiers[self._jobs[job_id].tier].reports_job_ends:
                    return None  # only `poll` sees it arrive
                jobs.append(job_id)
        return jobs

    def num_mapped(self, keys: Sequence[ChunkKey], num_bytes: int) -> int:
        """How many of `keys`, from the first, `lookup` would answer MAPPED from the first tier
        (not in host memory nor on their way there), found in one pass. The pins go through
        `queries` (`pin_mapped`, `release_mapped`)."""
        for count, key in enumerate(keys):
            if key in self.host.entries or key in self._promoting:
                keys = keys[:count]
                break
        return self.queries.num_mappable(0, keys, num_bytes) if self.tiers and keys else 0

    def count_lookups(self, answer: Lookup, count: int) -> None:
        """Count `count` first lookups the caller found answered `answer` in one pass: HIT
        (host memory), or MAPPED by the first tier (`num_mapped`)."""
        self.metrics.lookup(HOST, answer is Lookup.HIT, count=count)
        if answer is Lookup.MAPPED:
            self.metrics.lookup(self.tier_names[0], True, count=count)

    def _promote(self, index: int, key: ChunkKey, num_bytes: int) -> None:
        """Start copying `key` up from tier `index`, unless no host slot is free right now."""
        slot = self.host.prepare_store(key, num_bytes)
        if slot is None:
            return
        job = self._new_job(index, "promote", key, num_bytes, slot)
        self._promoting[key] = job.job_id
        self.watch.started(job.job_id)  # before the tier's thread can end it
        if self._held_loads is not None:
            self._held_loads[index].append(job)
        else:
            self._submit_loads(index, [job])

    def _submit_loads(self, index: int, jobs: list[TransferJob]) -> None:
        try:
            self.tiers[index].submit_loads(jobs)
        except Exception:  # a broken tier took none of them (SecondaryTier.submit_loads)
            self.metrics.error(self.tier_names[index])
            for job in jobs:
                del self._jobs[job.job_id]
                self.watch.ended(job.job_id)
                self._end_promotion(index, job.key, ok=False)

    def _end_promotion(self, index: int, key: ChunkKey, ok: bool) -> None:
        self._promoting.pop(key, None)
        self.host.complete_store(key, ok)
        if ok:
            self.queries.mark_held(index, key)
        else:
            self.queries.mark_failed(index, key)

    # ---- device <-> host (two-phase; the connector moves the bytes) ------------------------

    def record_use(self, key: ChunkKey) -> None:
        """A request contains `key` (counts towards store_threshold)."""
        self._uses[key] = self._uses.get(key, 0) + 1

    def prepare_store(self, key: ChunkKey, num_bytes: int) -> SlotId | None:
        """A host slot to copy `key` into from the device, or None: already in host, not used
        often enough yet, held by every tier in a file it loads from mapped (a host copy would
        be a second one in memory, and no tier lacks it; the pages are not checked, ~2.5 us a
        chunk), or no slot free of transfers (counted as a skipped store)."""
        threshold = self.config.store_threshold
        if threshold > 1 and self._uses.get(key, 0) < threshold:
            return None
        if self.tiers and key not in self.host.entries and all(
                self.queries.num_mappable(index, [key], num_bytes, in_memory=False)
                for index in range(len(self.tiers))):
            return None
        slot = self.host.prepare_store(key, num_bytes)
        if slot is None and key not in self.host.entries:
            self.metrics.skipped_store("no_host_slot")
        return slot

    def complete_store(self, key: ChunkKey, ok: bool) -> None:
        """The device->host copy of `key` ended; on success, cascade it to the write_through
        tiers that admit it, and keep it dirty until the host needs its slot clean if there are
        write_back tiers."""
        self.host.complete_store(key, ok)
        if not ok:
            return
        self._record([TierMoveEvent(key, DEVICE, HOST)])
        for index in self._targets(key, write_back=False):
            self._store_on(index, key)
        if self._write_back and not all(self.queries.holds(index, key) for index, back
                                        in enumerate(self._tier_write_back) if back):
            self.host.mark_dirty(key)

    def _targets(self, key: ChunkKey, write_back: bool) -> list[int]:
        """The tiers of that write policy whose admission rule `key` meets and that are not
        known to hold it."""
        hits = self._hits.get(key, 0)
        return [index for index, spec in enumerate(self.config.secondary_tiers)
                if self._tier_write_back[index] == write_back and hits >= spec.admit_after_hits
                and not self.queries.holds(index, key)]

    def _at_limit(self, index: int) -> bool:
        """The tier has max_pending_stores stores in flight: it takes no new one now."""
        limit = self.config.secondary_tiers[index].max_pending_stores
        return limit is not None and self._pending_stores[index] >= limit

    def _store_on(self, index: int, key: ChunkKey) -> None:
        if self._at_limit(index):
            self.metrics.dropped_store(self.tier_names[index], "backpressure")
            return
        self.host.prepare_load(key, count_use=False)  # the tier reads the slot: pin it
        entry = self.host.entries[key]
        if not self._submit_store(index, key, entry.num_bytes, entry.slot):
            self.host.complete_load(key)

    def prepare_loads(self, keys: Sequence[ChunkKey]) -> list[SlotId | None]:
        """Pin those of `keys` still in host memory for host->device copies; None for one
        evicted since its lookup (another request's promotion may take its slot)."""
        return self.host.prepare_loads(keys)

    def complete_loads(self, keys: Sequence[ChunkKey], ok: bool) -> None:
        """The host->device copies of `keys` ended; a success is a hit of each, which may
        admit it to write_through tiers with `admit_after_hits`."""
        self.host.complete_loads(keys)
        if not ok:
            return
        self._record(TierMoveEvent(key, HOST, DEVICE) for key in keys)
        if not self._counts_hits:
            return
        for key in keys:
            hits = self._hits[key] = self._hits.get(key, 0) + 1
            for index in self._targets(key, write_back=False):
                if self.config.secondary_tiers[index].admit_after_hits == hits:
                    self._store_on(index, key)

    # ---- tier jobs --------------------------------------------------------------------------

    def _new_job(self, index: int, kind: Literal["promote", "cascade"], key: ChunkKey,
                 num_bytes: int, slot: SlotId) -> TransferJob:
        """Register a tier job on host slot `slot`, with its deadline."""
        now = self._clock()
        job = TransferJob(next(self._job_ids), key, self.area.slot_view(slot, num_bytes),
                          now + self.config.tier_job_timeout_s)
        self._jobs[job.job_id] = _TierJob(kind, index, key, num_bytes, now)
        self._deadlines.append((job.deadline, job.job_id))
        return job

    def _submit_store(self, index: int, key: ChunkKey, num_bytes: int, slot: SlotId) -> bool:
        job = self._new_job(index, "cascade", key, num_bytes, slot)
        try:
            self.tiers[index].submit_store(job)
        except Exception:  # a broken tier is a failed job, never a crash
            del self._jobs[job.job_id]
            self.metrics.error(self.tier_names[index])
            return False
        self._pending_stores[index] += 1
        return True

    def poll(self) -> None:
        """Collect finished tier jobs and expire late ones. Call once per engine step."""
        self.collect()
        self._expire_late_jobs()
        if self._write_back:
            self.write_back.keep_reserve(
                len({job.key for job in self._jobs.values() if job.kind == "cascade"}))
            self.metrics.set_dirty(self.host.num_dirty, self.host.num_dropped_dirty)
        self.metrics.set_fill_ratio(self.host.fill_ratio)
        self.metrics.flush()

    def collect(self) -> None:
        """Take the jobs the tiers have finished (`poll` does, and more): a lookup between
        two polls sees the promotions that ended meanwhile."""
        for index, tier in enumerate(self.tiers):
            try:
                results = list(tier.get_finished_jobs())
            except Exception:
                self.metrics.error(self.tier_names[index])
                continue
            for result in results:
                job = self._jobs.pop(result.job_id, None)
                if job is None:
                    self.metrics.error(self.tier_names[index])  # a job we never gave it
                else:
                    self.watch.ended(result.job_id)  # if its tier did not say so itself
                    self._finish(job, result)

    def _finish(self, job: _TierJob, result: JobResult) -> None:
        name, ok = self.tier_names[job.tier], result.ok
        if result.skipped is not None:
            self.metrics.dropped_store(name, result.skipped)
        elif not ok and not job.expired:
            self.metrics.error(name)
        ok = ok and not job.expired
        if job.kind == "promote":
            self._end_promotion(job.tier, job.key, ok)
        else:
            self.host.complete_load(job.key)
            self._pending_stores[job.tier] -= 1
            if ok:
                self.queries.mark_stored(job.tier, job.key)
        if ok:
            source, destination = (name, HOST) if job.kind == "promote" else (HOST, name)
            self._record([TierMoveEvent(job.key, source, destination,
                                        self.tiers[job.tier].locality)])
            ended = self._clock() if result.ended is None else result.ended
            seconds = ended - job.started if result.seconds is None else result.seconds
            self.metrics.transfer(f"{source}_to_{destination}", job.num_bytes, seconds, ended)

    def _expire_late_jobs(self) -> None:
        # A late job keeps its slot pinned until the tier reports it: the tier may still be
        # using the buffer, so the slot cannot be handed to another chunk.
        now = self._clock()
        while self._deadlines and now > self._deadlines[0][0]:
            job_id = self._deadlines.popleft()[1]
            job = self._jobs.get(job_id)
            if job is None:  # reported in time
                continue
            job.expired = True
            self.metrics.error(self.tier_names[job.tier])
            if job.kind == "promote":
                self.watch.ended(job_id)
                self._promoting.pop(job.key, None)
                self.queries.mark_failed(job.tier, job.key)

    # ---- events, stats, shutdown ----------------------------------------------------------

    def _record(self, events: Iterable[TierMoveEvent]) -> None:
        """Append `events` after the host evictions made before them, so that a chunk evicted
        and stored again within one step is announced in that order."""
        self._events.extend(TierMoveEvent(key, HOST, None) for key in self.host.take_evicted())
        self._events.extend(events)

    def take_events(self) -> list[TierMoveEvent]:
        self._record(())
        evicted = []
        for index, tier in enumerate(self.tiers):
            try:
                dropped = tier.take_evicted()
            except Exception:  # a broken tier costs its events, never the step
                self.metrics.error(self.tier_names[index])
                continue
            for key in dropped:
                self.queries.mark_dropped(index, key)
                evicted.append(TierMoveEvent(key, self.tier_names[index], None, tier.locality))
        events, self._events = self._events + evicted, []
        return events

    def num_jobs_in_flight(self) -> int:
        return len(self._jobs)

    def flush(self, timeout_s: float) -> bool:
        """Write back every dirty chunk and wait until every tier job has ended or missed its
        own deadline (shutdown: what this instance computed reaches the tiers). False if
        `timeout_s` passed first."""
        deadline = self._clock() + timeout_s
        while True:
            self.write_back.write_all()  # as the write-back tiers' stores end, they take more
            self.poll()
            if not self.host.num_dirty and all(job.expired for job in self._jobs.values()):
                return True
            if self._clock() > deadline:
                return False
            time.sleep(_FLUSH_POLL_S)

    def shutdown(self) -> None:
        """Stop the tiers; each bounds its own wait (a tier stuck in I/O is abandoned)."""
        for tier in self.tiers:
            tier.shutdown()
