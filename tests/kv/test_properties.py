"""Property test: random admit / step / finish / preempt / evict / reset sequences over
full-attention and sliding-window groups keep every invariant after every step, and every
prefix hit hands out blocks whose content really is the request's tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.kv import KVCacheManager, Request, RequestStatus

from .kv_helpers import BLOCK_SIZE, config, full_spec, make_request, sliding_spec

SPEC_SETS = {
    "full": (full_spec(),),
    "sliding": (sliding_spec(window=9),),
    "full+sliding": (full_spec(), sliding_spec(window=6)),
}

OPS = st.one_of(
    st.tuples(st.just("add"), st.lists(st.integers(0, 2), min_size=1, max_size=24)),
    st.tuples(st.just("step"), st.integers(0, 7), st.integers(1, 9)),
    st.tuples(st.just("finish"), st.integers(0, 7)),
    st.tuples(st.just("preempt"), st.integers(0, 7)),
    st.tuples(st.just("evict"), st.integers(1, 23)),
    st.tuples(st.just("reset")),
)


@dataclass
class Simulation:
    """A scheduler stand-in plus the "device memory": block id -> {offset: token}."""

    manager: KVCacheManager
    windows: list[int | None]
    waiting: list[Request] = field(default_factory=list)
    running: list[Request] = field(default_factory=list)
    content: dict[int, dict[int, int]] = field(default_factory=dict)
    next_id: int = 0

    def check(self) -> None:
        active = {r.request_id for r in self.waiting + self.running}
        self.manager.check_invariants(active_request_ids=active)

    def add(self, tokens: list[int]) -> None:
        self.waiting.append(make_request(self.manager, f"r{self.next_id}", tokens))
        self.next_id += 1

    def pick(self, index: int) -> Request | None:
        everyone = self.waiting + self.running
        return everyone[index % len(everyone)] if everyone else None

    def step(self, index: int, chunk: int) -> None:
        request = self.pick(index)
        if request is None:
            return
        if request in self.waiting:
            self._admit(request, chunk)
        elif request.num_computed_tokens < request.num_tokens:
            self._compute(request, min(chunk, request.num_tokens - request.num_computed_tokens))

    def _admit(self, request: Request, chunk: int) -> None:
        hit, num_hit = self.manager.get_computed_blocks(request)
        assert num_hit % BLOCK_SIZE == 0 and num_hit <= request.num_tokens - 1
        self._check_hit_content(request, hit.blocks)
        num_new = min(chunk, request.num_tokens - num_hit)
        if self.manager.allocate_slots(request, num_new, num_hit, hit) is None:
            return
        self.waiting.remove(request)
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit
        self._write(request, num_new)

    def _compute(self, request: Request, num_new: int) -> None:
        if self.manager.allocate_slots(request, num_new) is not None:
            self._write(request, num_new)

    def _write(self, request: Request, num_new: int) -> None:
        """Fill the KV of the newly computed positions and check the window is backed."""
        start = request.num_computed_tokens
        end = start + num_new
        for window, table in zip(self.windows, self.manager.get_blocks(request.request_id).blocks):
            first_needed = 0 if window is None else max(0, start - window + 1)
            for position in range(first_needed, end):
                block = table[position // BLOCK_SIZE]
                assert not block.is_null, f"position {position} needed but null"
                if position >= start:
                    slot = self.content.setdefault(block.block_id, {})
                    slot[position % BLOCK_SIZE] = request.all_token_ids[position]
        request.num_computed_tokens = end
        if end == request.num_tokens:
            request.append_output_token_ids(request.all_token_ids[-1] ^ 1)

    def _check_hit_content(self, request: Request, hit_blocks) -> None:
        for table in hit_blocks:
            for j, block in enumerate(table):
                if block.is_null:
                    continue
                expected = {o: request.all_token_ids[j * BLOCK_SIZE + o]
                            for o in range(BLOCK_SIZE)}
                assert self.content.get(block.block_id) == expected, f"stale hit {block}"

    def finish(self, index: int) -> None:
        request = self.pick(index)
        if request is None:
            return
        self.manager.free(request)
        (self.waiting if request in self.waiting else self.running).remove(request)

    def preempt(self, index: int) -> None:
        if not self.running:
            return
        request = self.running.pop(index % len(self.running))
        self.manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.insert(0, request)

    def reset(self) -> None:
        holding = [r for r in self.running if any(self.manager.get_block_ids(r.request_id))]
        assert self.manager.reset_prefix_cache() is (not holding)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec_set=st.sampled_from(sorted(SPEC_SETS)), ops=st.lists(OPS, min_size=1, max_size=60))
def test_random_lifecycles_keep_invariants(spec_set, ops):
    specs = SPEC_SETS[spec_set]
    manager = KVCacheManager(config(24, *specs), max_model_len=512, watermark=0.05)
    windows = [getattr(spec, "sliding_window", None) for spec in specs]
    sim = Simulation(manager, windows)
    for op, *args in ops:
        if op == "evict":
            manager.evict_blocks({args[0]})
        else:
            getattr(sim, op)(*args)
        sim.check()
    for request in sim.waiting + sim.running:
        manager.free(request)
    manager.check_invariants(active_request_ids=set())
    assert manager.num_free_blocks == 23
