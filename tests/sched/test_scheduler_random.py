"""Random workloads with a misbehaving connector: invariants hold after every step and every
block comes back at the end."""

import random
from dataclasses import dataclass, field

import pytest

from kvtier.connector.base import KVConnectorOutput
from kvtier.kv import RequestStatus

from .sched_fakes import (
    BLOCK_SIZE,
    Clock,
    FakeRunner,
    ScriptedConnector,
    assert_all_free,
    make_manager,
    make_request,
    make_scheduler,
    step,
)

WAITING_STATES = {RequestStatus.WAITING, RequestStatus.PREEMPTED,
                  RequestStatus.WAITING_FOR_REMOTE_KVS}


@dataclass
class RandomConnector(ScriptedConnector):
    """Answers at random; remembers which loads and sends the fake worker must finish."""

    rng: random.Random = field(default_factory=random.Random)
    last_async: dict[str, bool] = field(default_factory=dict)
    last_local: dict[str, int] = field(default_factory=dict)
    # req_id -> block ids the load fills: async ones until the worker finishes them, sync
    # ones for the step they were scheduled in.
    loads: dict[str, list[int]] = field(default_factory=dict)
    sync_loads: dict[str, list[int]] = field(default_factory=dict)
    sends: set[str] = field(default_factory=set)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        roll = self.rng.random()
        if roll < 0.15:
            return None, False
        if roll < 0.5:
            return 0, False
        max_blocks = (request.num_tokens - num_computed_tokens) // BLOCK_SIZE
        num_external = self.rng.randint(0, max_blocks) * BLOCK_SIZE
        load_async = self.rng.random() < 0.7
        self.last_async[request.request_id] = load_async
        self.last_local[request.request_id] = num_computed_tokens
        return num_external, load_async

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if not num_external_tokens:
            return
        first = self.last_local[request.request_id] // BLOCK_SIZE
        num_blocks = -(-num_external_tokens // BLOCK_SIZE)
        filled = blocks.get_block_ids()[0][first:first + num_blocks]
        target = self.loads if self.last_async[request.request_id] else self.sync_loads
        target[request.request_id] = filled

    def request_finished(self, request, block_ids):
        delay = self.rng.random() < 0.3
        if delay:
            self.sends.add(request.request_id)
        return delay, None


def worker_report(connector: RandomConnector, rng: random.Random, out,
                  finish_all: bool = False) -> KVConnectorOutput:
    report = KVConnectorOutput()
    for block_ids in connector.sync_loads.values():
        if block_ids and not finish_all and rng.random() < 0.3:
            report.invalid_block_ids.add(rng.choice(block_ids))
    connector.sync_loads.clear()
    for req_id, block_ids in list(connector.loads.items()):
        if finish_all or rng.random() < 0.5:
            del connector.loads[req_id]
            report.finished_recving.add(req_id)
            if block_ids and not finish_all and rng.random() < 0.3:
                report.invalid_block_ids.add(rng.choice(block_ids))
    for req_id in list(connector.sends):
        if finish_all or rng.random() < 0.5:
            connector.sends.discard(req_id)
            report.finished_sending.add(req_id)
    return report


def check_scheduler(sched, out) -> None:
    assert all(r.status == RequestStatus.RUNNING for r in sched.running)
    assert all(r.status in WAITING_STATES for r in sched.waiting)
    assert len(sched.running) <= sched.config.max_num_seqs
    assert out.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
    assert not (out.finished_req_ids & set(out.num_scheduled_tokens))
    sched.kv_cache_manager.check_invariants()


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("sliding_window", [None, 8])
def test_random_workload_keeps_invariants_and_frees_everything(seed, policy, sliding_window):
    rng = random.Random(seed)
    manager = make_manager(14 if sliding_window is None else 20, sliding_window=sliding_window)
    clock = Clock()
    connector = RandomConnector(rng=random.Random(seed + 1000))
    sched = make_scheduler(manager, connector, clock, max_num_batched_tokens=16, max_num_seqs=4,
                           kv_load_timeout_s=5.0, kv_load_failure_policy=policy)
    runner = FakeRunner()
    prefixes = [list(range(p * 100, p * 100 + 8)) for p in range(3)]
    for index in range(60):
        if rng.random() < 0.4:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 9))]
            sched.add_request(make_request(f"r{index}", tokens, max_tokens=rng.randint(1, 12),
                                           arrival=float(index)))
        if sched.requests and rng.random() < 0.1:
            victim = rng.choice(sorted(sched.requests))
            sched.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
        clock.now += rng.choice([0.0, 0.5, 3.0])
        out = sched.schedule()
        check_scheduler(sched, out)
        sched.update_from_output(out, runner.execute(out, worker_report(connector, rng, out)))
        sched.kv_cache_manager.check_invariants()
    sched.finish_requests(list(sched.requests), RequestStatus.FINISHED_ABORTED)
    for _ in range(3):
        step(sched, runner, worker_report(connector, rng, None, finish_all=True))
    assert not sched.has_unfinished_requests() and not sched.has_pending_kv_transfers()
    assert_all_free(manager)
