"""What one `schedule()` call has decided so far: the step's batch under construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

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
    # The runner drops these before building `new_reqs`.
    dropped_req_ids: set[str] = field(default_factory=set)
    num_preempted: int = 0

    def add_new(self, request: Request, num_tokens: int) -> None:
        self.new_reqs.append(request)
        self._charge(request, num_tokens)

    def add_cached(self, request: Request, num_tokens: int,
                   new_block_ids: tuple[list[int], ...]) -> None:
        self.cached_reqs.append(request)
        self.new_block_ids[request.request_id] = new_block_ids
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
        self.dropped_req_ids.add(req_id)
        self.num_preempted += 1

    def _charge(self, request: Request, num_tokens: int) -> None:
        self.num_scheduled_tokens[request.request_id] = num_tokens
        self.token_budget -= num_tokens
