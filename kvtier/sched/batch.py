"""What one `schedule()` call has decided so far: the step's batch under construction."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

if TYPE_CHECKING:
    from kvtier.kv import Request


@dataclass
class StepBatch:
    token_budget: int
    # Requests the runner must (re)build from scratch: admitted from waiting, or resynced.
    new_reqs: list[Request] = field(default_factory=list)
    # Requests the runner already holds, with the block ids appended this step.
    cached_reqs: list[Request] = field(default_factory=list)
    new_block_ids: dict[str, tuple[list[int], ...]] = field(default_factory=dict)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # Draft tokens computed after a request's last token this step (speculative decoding).
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Tokens loaded synchronously this step by a connector, per newly admitted request.
    num_external_tokens: dict[str, int] = field(default_factory=dict)
    # The runner drops these before building `new_reqs`.
    dropped_req_ids: set[str] = field(default_factory=set)
    num_preempted: int = 0
    # LoRA adapter seats: the adapters of running requests, at most `max_loras` (None: any).
    max_loras: int | None = None
    loras: set[str] = field(default_factory=set)
    # A request waited for a seat this step: later adapter requests wait behind it (else new
    # requests of the seated adapters would keep their seats taken and it would never start).
    seat_blocked: bool = False

    def hold_loras(self, running: list[Request]) -> None:
        """Running requests keep their adapters' seats (scheduled this step or not), so no
        later step runs more than max_loras adapters."""
        self.loras.update(seat for seat in map(_seat, running) if seat is not None)

    def may_add_lora(self, request: Request) -> bool:
        """Whether `request` may start: no adapter, or a seat for it and no request of an
        adapter left waiting before it."""
        seat = _seat(request)
        if seat is None or self.max_loras is None:
            return True
        if not self.seat_blocked and (seat in self.loras or len(self.loras) < self.max_loras):
            return True
        self.seat_blocked = True
        return False

    def add_new(self, request: Request, num_tokens: int, num_external_tokens: int = 0) -> None:
        """`num_external_tokens`: how many of its computed tokens a connector loads during
        this step (their blocks are in the prefix cache already)."""
        self.new_reqs.append(request)
        if num_external_tokens:
            self.num_external_tokens[request.request_id] = num_external_tokens
        if _seat(request) is not None:
            self.loras.add(_seat(request))
        self._charge(request, num_tokens)

    def add_cached(self, request: Request, num_tokens: int,
                   new_block_ids: tuple[list[int], ...], drafts: list[int]) -> None:
        """`drafts`: the last `len(drafts)` of the `num_tokens` are these draft tokens."""
        self.cached_reqs.append(request)
        self.new_block_ids[request.request_id] = new_block_ids
        if drafts:
            self.spec_tokens[request.request_id] = drafts
        self._charge(request, num_tokens)

    def preempt(self, request: Request) -> None:
        """`request` lost its blocks; undo its place in this step if it had one."""
        req_id = request.request_id
        num_tokens = self.num_scheduled_tokens.pop(req_id, None)
        if num_tokens is not None:
            self.token_budget += num_tokens
            self.cached_reqs = [r for r in self.cached_reqs if r is not request]
            self.new_reqs = [r for r in self.new_reqs if r is not request]
            self.new_block_ids.pop(req_id, None)
            self.spec_tokens.pop(req_id, None)
            self.num_external_tokens.pop(req_id, None)
        self.dropped_req_ids.add(req_id)
        self.num_preempted += 1

    def to_output(self, finished_req_ids: set[str],
                  block_ids_of: Callable[[str], tuple[list[int], ...]]) -> SchedulerOutput:
        """The step's SchedulerOutput; `block_ids_of(req_id)` gives a new request's blocks."""
        return SchedulerOutput(
            scheduled_new_reqs=[_new_request_data(r, block_ids_of) for r in self.new_reqs],
            scheduled_cached_reqs=[
                CachedRequestData(r.request_id, self.new_block_ids[r.request_id],
                                  r.num_computed_tokens)
                for r in self.cached_reqs],
            num_scheduled_tokens=self.num_scheduled_tokens,
            total_num_scheduled_tokens=sum(self.num_scheduled_tokens.values()),
            finished_req_ids=finished_req_ids,
            preempted_req_ids=self.dropped_req_ids,
            scheduled_spec_decode_tokens=self.spec_tokens,
            num_external_computed_tokens=self.num_external_tokens)

    def _charge(self, request: Request, num_tokens: int) -> None:
        self.num_scheduled_tokens[request.request_id] = num_tokens
        self.token_budget -= num_tokens


def _seat(request: Request) -> str | None:
    """The seat a request's adapter takes: by content, so two names of one adapter share one,
    and a name unloaded and loaded again from another path takes another."""
    return request.lora.cache_key if request.lora is not None else request.lora_name


def _new_request_data(request: Request,
                      block_ids_of: Callable[[str], tuple[list[int], ...]]) -> NewRequestData:
    return NewRequestData(
        req_id=request.request_id,
        token_ids=list(request.all_token_ids),
        num_prompt_tokens=request.num_prompt_tokens,
        sampling_params=request.sampling_params,
        block_ids=block_ids_of(request.request_id),
        num_computed_tokens=request.num_computed_tokens,
        bad_words_token_ids=request.bad_words_token_ids, grammar=request.grammar,
        lora=request.lora)
