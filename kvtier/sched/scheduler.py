"""The scheduler: decides each step which requests run and how many tokens each computes.

One step is `schedule()` (a short pipeline of phases, below) followed by
`update_from_output()` once the model runner has run the batch. Requests whose KV arrives
asynchronously from a connector wait in WAITING_FOR_REMOTE_KVS in the waiting queue, and start
ahead of it once their KV has landed.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from kvtier.kv import Request, RequestStatus
from kvtier.sched.admission import Admission, plan_admission
from kvtier.sched.batch import StepBatch
from kvtier.sched.config import SchedulerConfig
from kvtier.sched.delayed_frees import DelayedFrees
from kvtier.sched.errors import SchedulerQueueFullError
from kvtier.sched.kv_loads import KVLoadTracker, promote_after_load
from kvtier.sched.lookups import ConnectorLookupDeadlines
from kvtier.sched.output import (
    EngineCoreOutput,
    ModelRunnerOutput,
    SchedulerOutput,
)
from kvtier.sched.request_queue import create_request_queue
from kvtier.sched.stats import SchedulerStats, take_stats
from kvtier.sched.stop import check_stop
from kvtier.sched.transfers import TransferFailures
from kvtier.spec_decode import DraftTracker

if TYPE_CHECKING:
    from kvtier.connector.base import KVConnectorOutput, KVConnectorScheduler
    from kvtier.kv import KVCacheBlocks, KVCacheManager

# While the connector answers "not yet" (KV on its way from a slower tier), the waiting queue is
# asked further only until the deferred requests hold this many steps' worth of tokens.
FETCH_LOOKAHEAD_STEPS = 2

class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 connector: KVConnectorScheduler | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.connector = connector
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(config.policy)
        self.running: list[Request] = []
        self.loads = KVLoadTracker(config.kv_load_timeout_s, clock)
        self.lookups = ConnectorLookupDeadlines(config.kv_load_timeout_s, clock)
        self.failures = TransferFailures(self, config.kv_load_failure_policy)
        # Finished since the last schedule(): the runner drops their state.
        self._finished_req_ids: set[str] = set()
        # Running requests whose KV was cut back (bad blocks): the runner must rebuild them.
        self.resync_req_ids: set[str] = set()
        # Requests whose external load failed or whose lookup missed its deadline: they
        # recompute instead of asking the connector again.
        self.no_external_load: set[str] = set()
        self._clock = clock
        # Finished requests whose blocks stay held until a transfer ends: the transfers
        # ("recving" | "sending") and when the engine stops waiting for them.
        self.delayed_frees = DelayedFrees(self._clock, config.kv_load_timeout_s, self._release)
        # Counted since the last make_stats().
        self.num_preemptions = 0
        self.connector_stats: dict[str, float] = {}
        self._worker_events: list[Any] = []
        # Requests schedule() finished (they could not grow): reported by update_from_output.
        self._capped_outputs: list[EngineCoreOutput] = []
        self.drafts = None if config.speculative is None else DraftTracker(config.speculative)

    # ---- requests in and out ---------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the scheduler; "
                             "use a unique id per request")
        limit = self.config.max_waiting_requests
        if limit is not None and len(self.waiting) >= limit:
            raise SchedulerQueueFullError(
                f"{len(self.waiting)} requests are waiting (max_waiting_requests={limit}); "
                "retry later")
        self.requests[request.request_id] = request
        self.waiting.add_request(request)

    def finish_requests(self, request_ids: str | Iterable[str],
                        finished_status: RequestStatus) -> None:
        """Finish requests from outside (abort, a stop string matched by the engine). Unknown
        or already finished ids are ignored."""
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"finished_status must be a FINISHED_* status, got "
                             f"{finished_status!r}")
        ids = (request_ids,) if isinstance(request_ids, str) else request_ids
        targets = [self.requests[i] for i in ids
                   if i in self.requests and not self.requests[i].is_finished()]
        self.remove_from_queues(targets)
        for request in targets:
            self.finish_request(request, finished_status)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    def has_pending_kv_transfers(self) -> bool:
        """Finished requests whose blocks wait for a transfer to end, or abandoned loads: the
        engine keeps stepping (with empty batches) so the worker can report them, for at
        most `kv_load_timeout_s`. The blocks of a transfer never reported stay held."""
        return self.delayed_frees.has_pending() or self.loads.has_orphans_in_time()

    # ---- schedule(): the step pipeline ---------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self.failures.abandon_overdue_loads()
        batch = StepBatch(token_budget=self.config.max_num_batched_tokens,
                          max_loras=self.config.max_loras)
        self._schedule_running(batch)
        batch.hold_loras(self.running)
        # A step that had to preempt is out of blocks: admitting newcomers would thrash.
        if not batch.num_preempted:
            self._schedule_landed_loads(batch)
            self._schedule_waiting(batch)
        finished, self._finished_req_ids = self._finished_req_ids, set()
        output = batch.to_output(finished, self.kv_cache_manager.get_block_ids)
        if self.connector is not None:
            output.kv_connector_metadata = self.connector.build_connector_meta(output)
        for req_id, num_tokens in output.num_scheduled_tokens.items():
            self.requests[req_id].num_computed_tokens += num_tokens
        return output

    def _schedule_running(self, batch: StepBatch) -> None:
        """Decodes and unfinished chunked prefills, in order; preempt when out of blocks."""
        index = 0
        while index < len(self.running) and batch.token_budget > 0:
            request = self.running[index]
            # Drafts get only what leaves a token for each running request after this one.
            spare = batch.token_budget - (len(self.running) - index - 1)
            drafts = [] if self.drafts is None or request.request_id in self.resync_req_ids \
                else self.drafts.draft(request, spare, self.config.max_model_len)
            num_new = min(request.num_tokens + len(drafts) - request.num_computed_tokens,
                          batch.token_budget)
            if num_new <= 0:
                # The runner sampled nothing for it last step; there is nothing to compute.
                index += 1
                continue
            new_blocks = self._allocate_or_preempt(request, num_new, batch)
            if new_blocks is None:
                break
            if request.request_id in self.resync_req_ids:
                self.resync_req_ids.discard(request.request_id)
                batch.dropped_req_ids.add(request.request_id)
                batch.add_new(request, num_new)
            else:
                batch.add_cached(request, num_new, new_blocks.get_block_ids(), drafts)
            index = self.running.index(request) + 1 if batch.num_preempted else index + 1

    def _allocate_or_preempt(self, request: Request, num_new: int,
                             batch: StepBatch) -> KVCacheBlocks | None:
        """Blocks for `num_new` more tokens, preempting others until they fit; None when the
        request itself had to be preempted."""
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            if new_blocks is not None:
                return new_blocks
            if self._can_never_grow(request):
                self._capped_outputs.append(
                    self._end_request(request, RequestStatus.FINISHED_LENGTH_CAPPED))
                return None
            victim = self._pick_victim()
            self._preempt(victim, batch)
            if victim is request:
                return None

    def _can_never_grow(self, request: Request) -> bool:
        """Out of blocks while it is the only request holding any: preempting it would only
        leave it waiting, at the head of the queue, for blocks that can never come. It ends
        as if it reached max_model_len (reported by the next update_from_output)."""
        return self.running == [request] and \
            self.kv_cache_manager.has_every_usable_block(request.request_id)

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request, batch: StepBatch) -> None:
        """Recompute-style preemption: drop the KV, restart from the head of the queue."""
        self.running.remove(request)
        batch.preempt(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.resync_req_ids.discard(request.request_id)
        self.waiting.prepend_request(request)

    def _has_room(self, batch: StepBatch) -> bool:
        return batch.token_budget > 0 and len(self.running) < self.config.max_num_seqs

    def _schedule_landed_loads(self, batch: StepBatch) -> None:
        """Start the requests whose load landed, ahead of the waiting queue. Admissions keep
        free the blocks these still need, so a newcomer ahead of them in the queue that does
        not fit beside that reserve would wait for them while they wait behind it: with
        nothing running, forever."""
        for req_id in self.loads.landed():
            if not self._has_room(batch):
                return
            request = self.requests[req_id]
            if not batch.may_add_lora(request):
                continue
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                failed = self.loads.is_failed(req_id)
                if failed:  # it recomputes what did not arrive
                    self.no_external_load.add(req_id)
                promote_after_load(request, failed, self.kv_cache_manager)
            if request.num_computed_tokens == 0:
                # Nothing it loaded was valid: a newcomer again, in its place in the queue.
                self.loads.forget(req_id)
                continue
            admission = plan_admission(
                request, self.kv_cache_manager, None, batch.token_budget,
                enable_chunked_prefill=self.config.enable_chunked_prefill, ask_connector=False)
            if (admission.num_new_tokens <= batch.token_budget
                    and self._admit(request, admission, batch)):
                self.waiting.remove_requests([request])

    def _schedule_waiting(self, batch: StepBatch) -> None:
        """Admit waiting requests in queue order until the budget, the seat cap or the blocks
        run out. Requests that cannot start yet keep their place for the next step."""
        skipped: list[Request] = []
        deferred_tokens = 0
        while len(self.waiting) > 0 and self._has_room(batch):
            request = self.waiting.peek_request()
            # _schedule_landed_loads starts the first; the other waits for an adapter seat.
            if request.request_id in self.loads or not batch.may_add_lora(request):
                skipped.append(self.waiting.pop_request())
                continue
            admission = self._plan_admission(request, batch)
            if admission is None:
                # Its KV is on the way from a slower tier. Every request asked starts such a
                # fetch, so asking the whole queue would fetch far more than the next steps can
                # use and overflow the tier the fetches land in (measured: the host tier evicting
                # fetched chunks before their use, the requests recomputing). Look ahead a few
                # steps' worth only.
                skipped.append(self.waiting.pop_request())
                deferred_tokens += request.num_tokens
                if deferred_tokens >= FETCH_LOOKAHEAD_STEPS * self.config.max_num_batched_tokens:
                    break
                continue
            if admission.num_new_tokens > batch.token_budget:
                break
            if not self._admit(request, admission, batch):
                break
            self.waiting.pop_request()
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                skipped.append(request)
        self.waiting.prepend_requests(skipped)

    def _plan_admission(self, request: Request, batch: StepBatch) -> Admission | None:
        """How `request` would start; None while the connector cannot tell yet."""
        req_id = request.request_id
        plan = functools.partial(plan_admission, request, self.kv_cache_manager, self.connector,
                                 batch.token_budget,
                                 enable_chunked_prefill=self.config.enable_chunked_prefill)
        admission = plan(ask_connector=req_id not in self.no_external_load)
        if self.lookups.is_overdue(req_id, undecided=admission is None):
            # The connector kept answering "not yet" for a whole deadline: go on without it.
            self.no_external_load.add(req_id)
            admission = plan(ask_connector=False)
        return admission

    def _admit(self, request: Request, admission: Admission, batch: StepBatch) -> bool:
        """Allocate and start the request (running, or loading); False if blocks ran out.
        The caller takes it out of the waiting queue."""
        already_computed = request.num_computed_tokens
        # A newcomer leaves free what the requests with a load still need; a request whose own
        # load landed (it computed tokens already) is one of those and may use it.
        reserved = 0 if already_computed else self.loads.num_blocks_to_finish(
            self.requests, self.kv_cache_manager)
        new_blocks = self.kv_cache_manager.allocate_slots(
            request, admission.num_new_tokens,
            num_new_computed_tokens=admission.num_local_tokens,
            new_computed_blocks=admission.computed_blocks,
            num_external_computed_tokens=admission.num_external_tokens,
            delay_cache_blocks=admission.load_async,
            full_sequence_must_fit=self.config.enable_chunked_prefill, reserved_blocks=reserved)
        if new_blocks is None:
            return False
        self.loads.forget(request.request_id)
        self.lookups.forget(request.request_id)
        if self.connector is not None:
            self.connector.update_state_after_alloc(
                request, self.kv_cache_manager.get_blocks(request.request_id),
                admission.num_external_tokens)
        request.num_computed_tokens = already_computed + admission.num_computed_tokens
        if admission.load_async:
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            self.loads.start(request.request_id)
            return True
        if request.num_cached_tokens is None:
            request.num_cached_tokens = request.num_computed_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        batch.add_new(request, admission.num_new_tokens, admission.num_external_tokens)
        return True

    # ---- update_from_output(): after the runner ------------------------------------------

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        kv_output = model_runner_output.kv_connector_output
        outputs, self._capped_outputs = self._capped_outputs, []
        discarded: set[str] = set()
        if kv_output is not None and kv_output.invalid_block_ids:
            discarded = self.failures.handle_invalid_blocks(kv_output.invalid_block_ids, outputs)
        stopped: set[str] = set()
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if req_id in discarded and request is not None and request.grammar is not None \
                    and model_runner_output.sampled_token_ids.get(req_id):
                request.grammar.undo_last()  # the token is dropped; so is its grammar step
            if request is None or request.is_finished() or req_id in discarded:
                continue
            error = model_runner_output.errors.get(req_id)
            if req_id in scheduler_output.scheduled_spec_decode_tokens and not error:
                self.drafts.settle(request, scheduler_output, model_runner_output)
            output = self._end_request(request, RequestStatus.FINISHED_ERROR, error) if error \
                else self._append_sampled(request, model_runner_output)
            if output is not None:
                outputs.append(output)
                if output.finished:
                    stopped.add(req_id)
        if stopped:
            self.running = [r for r in self.running if r.request_id not in stopped]
        if kv_output is not None:
            self._update_from_kv_output(kv_output)
        return outputs

    def _append_sampled(self, request: Request,
                        runner_output: ModelRunnerOutput) -> EngineCoreOutput | None:
        req_id = request.request_id
        sampled = runner_output.sampled_token_ids.get(req_id)
        if not sampled:
            return None
        kept: list[int] = []
        status = None
        for token_id in sampled:
            request.append_output_token_ids(token_id)
            kept.append(token_id)
            status = check_stop(request, self.config.max_model_len)
            if status is not None:
                break
        transfer = None if status is None else self.finish_request(request, status)
        return EngineCoreOutput(
            req_id=req_id, new_token_ids=kept, finish_reason=request.get_finished_reason(),
            stop_reason=request.stop_reason, num_cached_tokens=request.num_cached_tokens or 0,
            new_logprobs=runner_output.logprobs.get(req_id, [])[:len(kept)],
            prompt_logprobs=runner_output.prompt_logprobs.get(req_id), kv_transfer_params=transfer)

    def _end_request(self, request: Request, status: RequestStatus,
                     error: str | None = None) -> EngineCoreOutput:
        """Finish a request that cannot grow, or whose step failed in the runner."""
        request.error = error
        self.remove_from_queues([request])
        kv_transfer_params = self.finish_request(request, status)
        return EngineCoreOutput(req_id=request.request_id, new_token_ids=[],
                                finish_reason=request.get_finished_reason(),
                                num_cached_tokens=request.num_cached_tokens or 0,
                                kv_transfer_params=kv_transfer_params, error=error)

    def _update_from_kv_output(self, kv_output: KVConnectorOutput) -> None:
        for req_id in kv_output.finished_recving:
            orphaned = self.loads.take_orphaned_blocks(req_id)
            if orphaned is not None:
                self.kv_cache_manager.free_popped_blocks(orphaned)
            elif not self.delayed_frees.transfer_ended(req_id, "recving"):
                self.loads.mark_received(req_id)
        for req_id in kv_output.finished_sending:
            self.delayed_frees.transfer_ended(req_id, "sending")
        for name, value in kv_output.stats.items():
            self.connector_stats[name] = self.connector_stats.get(name, 0.0) + value
        if self.kv_cache_manager.enable_kv_cache_events:
            self._worker_events.extend(kv_output.events)
        elif self.connector is not None:
            self.connector.take_events()  # nobody takes them when events are off: drop them
        if self.connector is not None:
            self.connector.update_connector_output(kv_output)

    # ---- finishing and freeing -----------------------------------------------------------

    def remove_from_queues(self, requests: list[Request]) -> None:
        doomed = {r.request_id for r in requests}
        self.running = [r for r in self.running if r.request_id not in doomed]
        self.waiting.remove_requests(requests)

    def finish_request(self, request: Request,
                       status: RequestStatus) -> dict[str, Any] | None:
        """Mark finished and free its blocks, or hold them while a transfer still uses them.
        Returns the connector's kv_transfer_params. The caller removed it from the queues."""
        req_id = request.request_id
        loading = self.loads.is_in_flight(req_id)
        self.loads.forget(req_id)
        self.lookups.forget(req_id)
        request.status = status
        self._finished_req_ids.add(req_id)
        self.resync_req_ids.discard(req_id)
        self.no_external_load.discard(req_id)
        if self.drafts is not None:
            self.drafts.forget(req_id)
        delay_free, kv_transfer_params = False, None
        if self.connector is not None:
            # The connector interface takes one block list: the first KV cache group's.
            delay_free, kv_transfer_params = self.connector.request_finished(
                request, self.kv_cache_manager.get_block_ids(req_id)[0])
        pending = {"recving"} if loading else set()
        if delay_free:
            pending.add("sending")
        self.delayed_frees.hold(req_id, pending)
        return kv_transfer_params

    def _release(self, req_id: str) -> None:
        self.kv_cache_manager.free(self.requests.pop(req_id))

    # ---- stats, events, shutdown ---------------------------------------------------------

    def make_stats(self) -> SchedulerStats:
        return take_stats(self)

    def take_kv_events(self) -> list[Any]:
        """Device-cache events, then the connector's, then the worker connector's."""
        events = list(self.kv_cache_manager.take_events())
        if self.connector is not None:
            events.extend(self.connector.take_events())
        events.extend(self._worker_events)
        self._worker_events = []
        return events

    def shutdown(self, last_kv_output: KVConnectorOutput | None = None) -> None:
        """Stop the connector, after giving it the worker half's last report."""
        if self.connector is not None:
            if last_kv_output is not None:
                self.connector.update_connector_output(last_kv_output)
            self.connector.shutdown()
