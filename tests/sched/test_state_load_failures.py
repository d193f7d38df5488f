"""A bad loaded block in a model with a recurrent-state group: the request can only resume where
its state is still held, so it starts over in fresh blocks rather than from the bad block."""

from kvtier.connector.base import KVConnectorOutput
from kvtier.kv import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    MambaSpec,
    RequestStatus,
)

from .sched_fakes import (
    BLOCK_SIZE,
    FakeRunner,
    ScriptedConnector,
    assert_all_free,
    make_request,
    make_scheduler,
    prompt,
    step,
)


def hybrid_manager() -> KVCacheManager:
    groups = [KVCacheGroupSpec(["layers.0"], FullAttentionSpec(BLOCK_SIZE, 1, 8)),
              KVCacheGroupSpec(["layers.1"], MambaSpec(BLOCK_SIZE, ((2, 8),)))]
    return KVCacheManager(KVCacheConfig(32, groups), max_model_len=64, watermark=0.0)


def test_an_async_load_with_a_bad_block_starts_over():
    manager = hybrid_manager()
    sched = make_scheduler(manager, ScriptedConnector(answers={"a": [(8, True)]}))
    runner = FakeRunner()
    sched.add_request(make_request("a", prompt(0, 12), max_tokens=1))
    step(sched, runner)  # blocks for the 8 loaded tokens
    attention, state = manager.get_block_ids("a")
    assert state[0] == 0 and state[1] != 0  # only the state after token 8 is loaded
    bad = KVConnectorOutput(finished_recving={"a"}, invalid_block_ids={attention[1]})
    step(sched, runner, bad)  # tokens 4..7 arrived bad: no state after 4 to resume from
    assert sched.requests["a"].num_computed_tokens == 0
    out, core = step(sched, runner)
    new = out.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 0 and 0 not in new.block_ids[1]  # fresh, no holes
    assert out.num_scheduled_tokens == {"a": 12}
    assert core[0].finish_reason == "length"
    assert_all_free(manager)


def test_a_running_request_on_a_bad_block_starts_over_in_new_blocks():
    manager = hybrid_manager()
    sched = make_scheduler(manager, ScriptedConnector(answers={"a": [(8, False)]}))
    runner = FakeRunner()
    sched.add_request(make_request("a", prompt(0, 12), max_tokens=2))
    out = sched.schedule()  # a synchronous load: it runs at once from token 8
    attention, state = manager.get_block_ids("a")
    assert out.num_scheduled_tokens == {"a": 4} and state[0] == 0
    core = sched.update_from_output(out, runner.execute(
        out, KVConnectorOutput(invalid_block_ids={attention[0]})))
    assert core == []  # the token sampled from bad KV is dropped
    request = sched.requests["a"]
    assert (request.status, request.num_computed_tokens) == (RequestStatus.RUNNING, 0)
    assert manager.get_block_ids("a") == ([], [])  # its tables had holes: given back
    out, core = step(sched, runner)  # the runner rebuilds it from token 0
    assert out.preempted_req_ids == {"a"}
    new = out.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 0 and 0 not in new.block_ids[1]
    assert out.num_scheduled_tokens == {"a": 12}
    assert [o.new_token_ids for o in core] == [[12]]
    step(sched, runner)
    assert_all_free(manager)
