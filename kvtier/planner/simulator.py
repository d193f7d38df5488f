"""A discrete-event simulation of the engine serving a trace: the real KVCacheManager decides
every device prefix hit and eviction, the offload tiers' own caches and policies (tiers.py)
decide every host and disk hit, and the cost model advances the clock. No model runs and no KV
bytes exist.

Each step schedules as the engine does: running requests first, in the order they started (one
token per decoding request, the next prefill chunk of one still in prefill), then waiting
requests in arrival order while the token budget, `max_num_seqs` and the device pool allow. A
step costs what the cost model says for what it computes, so a queue forms whenever arrivals
ask for more than the steps can serve. A request's lookups happen
when it is admitted: its device prefix hit, then the chunks after it found in host memory or a
secondary tier (capped like the engine's, so the last prompt token is always recomputed).

Where the simulation is simpler than the engine: a request gets the blocks of its whole prompt
and output at admission (so it is never preempted, and its prompt blocks can be hit from then
on, not chunk by chunk); a request that did not fit is looked up again only once a request has
finished (the engine asks every step, to the same answer but for the promotions a lookup
starts); tier loads are synchronous and add their cost to the step that admits the request;
stores to the tiers run beside the steps, so the chunks a step computes add their store cost
to the next step (as the engine's next step waits for the device copies, and tier writes take
the cores the steps use), less the time the engine spends idle before it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvtier.kv import KVCacheManager
from kvtier.kv.hashing import BlockHash
from kvtier.kv.request import Request, RequestStatus
from kvtier.offload.config import OffloadConfig
from kvtier.planner.cost_model import CostModel, prefill_pairs
from kvtier.planner.model_kv import ModelKV
from kvtier.planner.tiers import SimulatedOffload


@dataclass(frozen=True)
class SchedulerLimits:
    """The engine's scheduler options that shape the simulation (the engine's defaults)."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    watermark: float = 0.01

    def __post_init__(self) -> None:
        # (below 1, no request is ever admitted and the simulation would never end)
        for flag, value in (("--max-num-batched-tokens", self.max_num_batched_tokens),
                            ("--max-num-seqs", self.max_num_seqs)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")


@dataclass
class SimRequest:
    """One request of the plan and what happened to it (tokens, seconds of simulated time)."""

    index: int
    arrival_s: float
    num_prompt_tokens: int
    output_tokens: int
    keys: list[BlockHash]  # the prompt's full blocks
    # Prompt tokens served by each level: device, host memory, then each secondary tier.
    hit_tokens: list[int] = field(default_factory=list)
    num_prefilled: int = 0  # prompt tokens computed or loaded
    num_output: int = 0
    num_stored_chunks: int = 0
    admitted_s: float | None = None  # when it got its blocks: the time before is queueing
    first_token_s: float | None = None
    finished_s: float | None = None
    rejected: str | None = None
    kv: Request | None = None

    @property
    def in_prefill(self) -> bool:
        return self.num_prefilled < self.num_prompt_tokens


@dataclass
class _Step:
    prefill: list[tuple[SimRequest, int]] = field(default_factory=list)
    decode: list[SimRequest] = field(default_factory=list)
    load_s: float = 0.0


class Simulation:
    """One engine with a device pool of `device_bytes` and optional offload tiers."""

    def __init__(self, model: ModelKV, device_bytes: int, offload: OffloadConfig | None,
                 cost: CostModel | None, limits: SchedulerLimits = SchedulerLimits()) -> None:
        self.model = model
        self.cost = cost
        self.limits = limits
        self.manager = KVCacheManager(model.kv_cache_config(device_bytes), model.max_model_len,
                                      watermark=limits.watermark)
        self.block_size = model.block_size
        self.blocks_per_chunk = 1 if offload is None else offload.blocks_per_chunk
        self.chunk_bytes = model.bytes_per_block * self.blocks_per_chunk
        self.offload = None if offload is None else SimulatedOffload(offload, self.chunk_bytes)
        if cost is not None and self.offload is not None:
            for tier in self.offload.all_tiers:
                cost.load_s(tier.kind, 0)  # a tier the cost model has no price for: fail now
        self.now = 0.0
        # Seconds of tier stores not done yet: they run beside the steps (the engine's next
        # step waits for its device copies; tier writes take the cores the steps would).
        self.store_backlog_s = 0.0
        self.num_steps = 0
        self.num_finished = 0
        # num_finished when the head of the queue last did not fit; blocks are only freed when
        # a request finishes, so until then another try would fail the same way.
        self._blocked_at: int | None = None

    @property
    def level_names(self) -> list[str]:
        tiers = [] if self.offload is None else [t.name for t in self.offload.all_tiers]
        return ["device", *tiers]

    def run(self, requests: list[SimRequest]) -> list[SimRequest]:
        """Serve every request (sorted by arrival) and return them, filled in."""
        pending = deque(sorted(requests, key=lambda r: (r.arrival_s, r.index)))
        waiting: deque[SimRequest] = deque()
        running: list[SimRequest] = []
        while pending or waiting or running:
            while pending and pending[0].arrival_s <= self.now:
                waiting.append(pending.popleft())
            if not waiting and not running:
                # The stores go on while the engine is idle.
                self.store_backlog_s = max(0.0, self.store_backlog_s
                                           - (pending[0].arrival_s - self.now))
                self.now = pending[0].arrival_s
                continue
            step = self._schedule(waiting, running)
            if step.prefill or step.decode:
                self._advance(step, running)
        return requests

    # ---- scheduling ------------------------------------------------------------------------

    def _schedule(self, waiting: deque[SimRequest], running: list[SimRequest]) -> _Step:
        step = _Step()
        budget = self.limits.max_num_batched_tokens
        # In the order they started, as the engine: a decode takes one token of the budget, a
        # prefill the rest of its prompt or what is left; those after the budget wait a step.
        for request in running:
            if budget <= 0:
                break
            if request.in_prefill:
                budget -= self._add_chunk(step, request, budget)
            else:
                step.decode.append(request)
                budget -= 1
        while waiting and budget > 0 and len(running) < self.limits.max_num_seqs:
            if running and self._blocked_at == self.num_finished:
                break  # nothing was freed since the head of the queue last failed to fit
            request = waiting[0]
            load_s = self._admit(request)
            if load_s is None:
                if running:
                    # It waits for blocks to free up, and so does every later arrival.
                    self._blocked_at = self.num_finished
                    break
                request.rejected = (f"needs more blocks than the device pool's "
                                    f"{self.manager.kv_cache_config.num_blocks}")
            self._blocked_at = None
            waiting.popleft()
            if request.rejected is None:
                request.admitted_s = self.now
                running.append(request)
                step.load_s += load_s
                budget -= self._add_chunk(step, request, budget)
        return step

    @staticmethod
    def _add_chunk(step: _Step, request: SimRequest, budget: int) -> int:
        num_tokens = min(request.num_prompt_tokens - request.num_prefilled, budget)
        step.prefill.append((request, num_tokens))
        return num_tokens

    def _admit(self, request: SimRequest) -> float | None:
        """Look the request up and give it its blocks; the seconds its tier loads take, or
        None when the device pool cannot hold it now."""
        if request.num_prompt_tokens + request.output_tokens > self.model.max_model_len:
            request.rejected = (f"prompt and output ({request.num_prompt_tokens} + "
                                f"{request.output_tokens} tokens) exceed max_model_len "
                                f"{self.model.max_model_len}")
            return 0.0
        if request.kv is None:
            keys = request.keys
            request.kv = Request(f"plan-{request.index}", [0] * request.num_prompt_tokens,
                                 block_hasher=lambda r: keys[len(r.block_hashes):])
        kv = request.kv
        blocks, num_device = self.manager.get_computed_blocks(kv)
        pinned = self._offloaded_chunks(request, num_device)
        first_chunk = num_device // (self.block_size * self.blocks_per_chunk)
        num_external = max(0, (first_chunk + len(pinned)) * self.block_size
                           * self.blocks_per_chunk - num_device)
        allocated = self.manager.allocate_slots(
            kv, request.num_prompt_tokens - num_device - num_external,
            num_new_computed_tokens=num_device, new_computed_blocks=blocks,
            num_external_computed_tokens=num_external,
            # The last output token is sampled, never computed: it takes no slot.
            num_lookahead_tokens=request.output_tokens - 1, full_sequence_must_fit=True)
        if self.offload is not None:
            self.offload.release(pinned, loaded=allocated is not None)
        if allocated is None:
            return None
        kv.status = RequestStatus.RUNNING
        kv.num_computed_tokens = num_device + num_external
        request.num_prefilled = num_device + num_external
        if pinned:  # what it loads is in memory already (host, a mapped file): not stored
            request.num_stored_chunks = max(request.num_stored_chunks, first_chunk + len(pinned))
        return self._count_hits(request, num_device, num_external, pinned)

    def _offloaded_chunks(self, request: SimRequest, num_device: int) -> list[tuple[Any, int]]:
        """(key, level) of each chunk after the device hit that a tier holds, up to the first
        one none does, pinned in host memory (see SimulatedOffload.pin)."""
        if self.offload is None:
            return []
        per_chunk = self.blocks_per_chunk
        num_loadable = min(len(request.keys), (request.num_prompt_tokens - 1) // self.block_size)
        found = []
        for chunk in range(num_device // (self.block_size * per_chunk), num_loadable // per_chunk):
            key = request.keys[(chunk + 1) * per_chunk - 1]
            level = self.offload.find(key)
            if level is None:
                break
            found.append((key, level))
        return self.offload.pin(found)

    def _count_hits(self, request: SimRequest, num_device: int, num_external: int,
                    loaded: list[tuple[Any, int]]) -> float:
        """Count the request's hits per level and its chunks' uses; the seconds its loads take."""
        hits = [0] * len(self.level_names)
        hits[0] = num_device
        seconds = 0.0
        # A chunk the device partly holds loads only its other blocks.
        skipped = len(loaded) * self.block_size * self.blocks_per_chunk - num_external
        for position, (_, level) in enumerate(loaded):
            num_tokens = self.block_size * self.blocks_per_chunk - (skipped if position == 0
                                                                     else 0)
            hits[level + 1] += num_tokens
            seconds += self._load_s(level, num_tokens * self.model.bytes_per_token)
        if self.offload is not None:
            for chunk in range(len(request.keys) // self.blocks_per_chunk):
                self.offload.record_use(request.keys[(chunk + 1) * self.blocks_per_chunk - 1])
        request.hit_tokens = hits
        return seconds

    def _load_s(self, level: int, num_bytes: float) -> float:
        if self.cost is None:
            return 0.0
        tiers = self.offload.all_tiers
        # From a secondary tier into host memory, then from host memory into the device.
        seconds = self.cost.load_s(tiers[0].kind, int(num_bytes))
        if level > 0:
            seconds += self.cost.load_s(tiers[level].kind, int(num_bytes))
        return seconds

    # ---- running a step --------------------------------------------------------------------

    def _advance(self, step: _Step, running: list[SimRequest]) -> None:
        seconds = 0.0 if self.cost is None else self._step_s(step)
        stored_before = None if self.offload is None else list(self.offload.num_stored)
        for request, num_tokens in step.prefill:
            request.num_prefilled += num_tokens
            self._store(request)
        if self.cost is not None:
            # This step waits for the stores still running; its own run beside the next one.
            self.now += seconds + self.store_backlog_s
            self.store_backlog_s = self._store_s(stored_before)
        self.num_steps += 1
        for request, _ in step.prefill:
            if not request.in_prefill:
                request.first_token_s = self.now
                request.num_output = 1
        for request in step.decode:
            request.num_output += 1
        for request in [r for r, _ in step.prefill] + step.decode:
            if request.num_output >= request.output_tokens:
                request.finished_s = self.now
                self.num_finished += 1
                self.manager.free(request.kv)
                request.kv = None
                running.remove(request)

    def _step_s(self, step: _Step) -> float:
        """The step's cost, from what it computes and the context each token attends to."""
        num_prefill = sum(num_tokens for _, num_tokens in step.prefill)
        pairs = sum(prefill_pairs(num_tokens, request.num_prefilled)
                    for request, num_tokens in step.prefill)
        # A decoding sequence's new token attends to the prompt and every output so far.
        context = sum(r.num_prompt_tokens + r.num_output for r in step.decode)
        # Streamed: a token per decode, and the first token of each prefill this step ends.
        num_streamed = len(step.decode) + sum(
            num_tokens == request.num_prompt_tokens - request.num_prefilled
            for request, num_tokens in step.prefill)
        return (self.cost.step_s(num_prefill, len(step.decode), pairs, context) + step.load_s
                + self.cost.served_s(num_streamed))

    def _store_s(self, stored_before: list[int] | None) -> float:
        """The seconds of the chunks stored to each tier since `stored_before` (its counts)."""
        if stored_before is None:
            return 0.0
        return sum(self.cost.store_s(tier.kind, (now - before) * self.chunk_bytes)
                   for tier, now, before in zip(self.offload.all_tiers, self.offload.num_stored,
                                                stored_before))

    def _store(self, request: SimRequest) -> None:
        """Offload the prompt chunks the request has computed since its last step. (The engine
        counts uses of prompt chunks only, so generated blocks never reach store_threshold.)"""
        if self.offload is None:
            return
        per_chunk = self.blocks_per_chunk
        num_blocks = min(len(request.keys), request.num_prefilled // self.block_size)
        num_chunks = num_blocks // per_chunk
        for chunk in range(request.num_stored_chunks, num_chunks):
            self.offload.store(request.keys[(chunk + 1) * per_chunk - 1])
        request.num_stored_chunks = max(request.num_stored_chunks, num_chunks)
