"""Real KVCacheManager + real Scheduler, driven by a fake model runner and scripted connectors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtier.connector.base import (
    ConnectorContext,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorScheduler,
)
from kvtier.kv import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    KVIdentity,
    MambaSpec,
    Request,
    RequestStatus,
    SlidingWindowSpec,
    make_block_hasher,
)
from kvtier.sampling_params import SamplingParams
from kvtier.sched import ModelRunnerOutput, Scheduler, SchedulerConfig, SchedulerOutput

BLOCK_SIZE = 4
EOS = 999


def make_manager(num_blocks: int, *, enable_caching: bool = True,
                 sliding_window: int | None = None, recurrent_state: bool = False,
                 enable_kv_cache_events: bool = False) -> KVCacheManager:
    """One full-attention group; with `sliding_window`, a second, sliding-window group; with
    `recurrent_state`, a second, Mamba-style state group."""
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8)
    groups = [KVCacheGroupSpec(["layers.0"], spec)]
    if sliding_window is not None:
        groups.append(KVCacheGroupSpec(["layers.1"], SlidingWindowSpec(
            block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, sliding_window=sliding_window)))
    if recurrent_state:
        groups.append(KVCacheGroupSpec(["layers.1"], MambaSpec(BLOCK_SIZE, ((2, 8),))))
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=groups)
    return KVCacheManager(config, max_model_len=64, enable_caching=enable_caching, watermark=0.0,
                          enable_kv_cache_events=enable_kv_cache_events)


def make_request(req_id: str, prompt: list[int], *, arrival: float = 0.0, priority: int = 0,
                 **params: Any) -> Request:
    params.setdefault("max_tokens", 4)
    return Request(req_id, prompt, SamplingParams(**params), arrival_time=arrival,
                   priority=priority, eos_token_id=EOS,
                   block_hasher=make_block_hasher(BLOCK_SIZE))


def prompt(start: int, length: int) -> list[int]:
    return list(range(start, start + length))


class Clock:
    """A clock the tests move by hand, for load deadlines."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeRunner:
    """Keeps per-request state from SchedulerOutput the way the model runner does, checks that
    every scheduled token has a slot, and samples scripted (or counting) tokens."""

    def __init__(self, block_size: int = BLOCK_SIZE) -> None:
        self.block_size = block_size
        self.tokens: dict[str, list[int]] = {}
        self.block_ids: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}
        # req_id -> tokens to sample, in order; others sample last token + 1.
        self.script: dict[str, list[int]] = {}

    def execute(self, out: SchedulerOutput,
                kv_output: KVConnectorOutput | None = None) -> ModelRunnerOutput:
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            for table in (self.tokens, self.block_ids, self.num_computed):
                table.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            self.tokens[new.req_id] = list(new.token_ids)
            self.block_ids[new.req_id] = list(new.block_ids[0])
            self.num_computed[new.req_id] = new.num_computed_tokens
        for cached in out.scheduled_cached_reqs:
            assert self.num_computed[cached.req_id] <= cached.num_computed_tokens
            self.block_ids[cached.req_id].extend(cached.new_block_ids[0])
            self.num_computed[cached.req_id] = cached.num_computed_tokens
        sampled: dict[str, list[int]] = {}
        for req_id, num in out.num_scheduled_tokens.items():
            end = self.num_computed[req_id] + num
            assert end <= len(self.tokens[req_id]), f"{req_id} scheduled past its tokens"
            assert len(self.block_ids[req_id]) * self.block_size >= end, f"{req_id} lacks slots"
            self.num_computed[req_id] = end
            if end == len(self.tokens[req_id]):
                token = self._next_token(req_id)
                self.tokens[req_id].append(token)
                sampled[req_id] = [token]
            else:
                sampled[req_id] = []
        return ModelRunnerOutput(list(out.num_scheduled_tokens), sampled,
                                 kv_connector_output=kv_output)

    def _next_token(self, req_id: str) -> int:
        script = self.script.get(req_id)
        if script:
            return script.pop(0)
        return self.tokens[req_id][-1] + 1


@dataclass
class StepMeta(KVConnectorMetadata):
    step: int = 0


@dataclass
class ScriptedConnector(KVConnectorScheduler):
    """Scheduler-side connector whose answers the test sets per request id."""

    # req_id -> list of answers to successive get_num_new_matched_tokens calls; the last
    # answer repeats. Unlisted requests: (0, False).
    answers: dict[str, list[tuple[int | None, bool]]] = field(default_factory=dict)
    # Requests whose blocks the producer keeps until finished_sending.
    delay_free: set[str] = field(default_factory=set)
    queries: list[tuple[str, int]] = field(default_factory=list)
    allocs: list[tuple[str, list[int], int]] = field(default_factory=list)
    alloc_statuses: list[RequestStatus] = field(default_factory=list)
    finished: list[tuple[str, list[int]]] = field(default_factory=list)
    outputs: list[KVConnectorOutput] = field(default_factory=list)
    # Events the scheduler half has for the next take_events.
    events: list[Any] = field(default_factory=list)
    num_metas: int = 0

    def __post_init__(self) -> None:
        identity = KVIdentity("test", "test-weights", "float32", BLOCK_SIZE, "test-layout",
                              ("full_attention",))
        super().__init__(None, ConnectorContext(block_size=BLOCK_SIZE, num_layers=1,
                                                kv_identity=identity))

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        self.queries.append((request.request_id, num_computed_tokens))
        answers = self.answers.get(request.request_id)
        if not answers:
            return 0, False
        return answers.pop(0) if len(answers) > 1 else answers[0]

    def update_state_after_alloc(self, request: Request, blocks: Any,
                                 num_external_tokens: int) -> None:
        self.allocs.append((request.request_id, blocks.get_block_ids()[0], num_external_tokens))
        self.alloc_statuses.append(request.status)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        self.num_metas += 1
        return StepMeta(step=self.num_metas)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.outputs.append(output)

    def take_events(self) -> list[Any]:
        events, self.events = self.events, []
        return events

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.finished.append((request.request_id, list(block_ids)))
        delay = request.request_id in self.delay_free
        return delay, ({"remote_blocks": list(block_ids)} if delay else None)


def make_scheduler(manager: KVCacheManager, connector: KVConnectorScheduler | None = None,
                   clock: Clock | None = None, **options: Any) -> Scheduler:
    options.setdefault("max_num_batched_tokens", 64)
    options.setdefault("max_num_seqs", 8)
    options.setdefault("max_model_len", 64)
    config = SchedulerConfig(**options)
    if clock is None:
        return Scheduler(config, manager, connector)
    return Scheduler(config, manager, connector, clock=clock)


def assert_all_free(manager: KVCacheManager) -> None:
    """No request holds a block: every usable block is back in the free queue."""
    manager.check_invariants(set())
    assert manager.num_free_blocks == manager.kv_cache_config.num_blocks - 1


def step(scheduler: Scheduler, runner: FakeRunner,
         kv_output: KVConnectorOutput | None = None) -> tuple[SchedulerOutput, list]:
    """One engine step: schedule, run, update. Returns the schedule and the core outputs."""
    out = scheduler.schedule()
    return out, scheduler.update_from_output(out, runner.execute(out, kv_output))


def run_to_completion(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 50) -> dict:
    """Step until nothing is left; returns req_id -> (all new token ids, finish reason)."""
    results: dict[str, tuple[list[int], str | None]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return results
        for output in step(scheduler, runner)[1]:
            tokens, _ = results.get(output.req_id, ([], None))
            results[output.req_id] = (tokens + output.new_token_ids, output.finish_reason)
    raise AssertionError(f"requests still unfinished after {max_steps} steps")
