"""A request waiting for its chunks to come up from disk never holds back one whose prefix is in
host memory, and neither stalls the other.

The engine, with host memory and a disk tier, gets a request whose first chunks are on disk
only and then one whose prefix is in host memory. The first one's lookup answers "not yet"
while its chunks come up from disk; the second loads its host chunks in the step that admits it
and computes at once. Once the first one's chunks are up, it does not fit beside the blocks the
second holds, so it waits for them. (With an asynchronous load, the same order once stalled the
queue for good in a server under mixed load; tests/sched/test_landed_loads.py holds the
scheduler to that case with a connector whose loads are asynchronous.)
"""

import time

from kvtier import LLM, SamplingParams
from kvtier.offload.config import CONNECTOR_NAME, parse_kv_offload

from ..tiny_models import hf_greedy, make_hf_model, random_prompts

PROMPT_LEN = 60  # 15 blocks of 4, 14 of them loadable (the last token is always recomputed)
# The on-disk request's prefix that an earlier instance computed: 2 chunks of one block.
DISK_PREFIX_LEN = 8
MAX_TOKENS = 3
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Far more steps than the two requests need (about 10); a stalled queue never ends.
MAX_STEPS = 500
# Time for the first step's disk reads to end before the next step: the on-disk chunks are up
# while the other request still runs.
TRANSFER_WAIT_S = 0.5


def _llm(model_dir, disk_dir) -> LLM:
    # The on-disk chunks come up through host memory, so that a request waits for them: loads
    # straight from the disk tier's mapped file (no wait) are off.
    extra = parse_kv_offload(f"host=1MiB,disk={disk_dir}:64MiB")
    extra["secondary_tiers"][0]["direct_loads"] = False
    # 24 usable device blocks: either prompt fits (16 blocks with its output), not both.
    return LLM(model_dir, dtype="float32", block_size=4, num_device_blocks=25, max_num_seqs=2,
               kv_transfer_config={"kv_connector": CONNECTOR_NAME,
                                   "kv_connector_extra_config": extra})


def _generate(llm: LLM, prompt: list[int]) -> None:
    llm.generate([{"prompt_token_ids": prompt}], PARAMS)
    # One more (empty) step: the worker half fences the last step's copies and reports them.
    llm.engine.step()
    assert llm.engine.scheduler.connector.flush(timeout_s=30), "cascade to the disk hangs"


def _run(engine, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, PARAMS)
    finals = {}
    # on-disk deferred while its chunks come up; in-host loaded and computed in the same step
    assert [output.request_id for output in engine.step()] == ["in-host"]
    time.sleep(TRANSFER_WAIT_S)
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            return finals
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output.outputs[0].token_ids
    raise AssertionError(f"after {MAX_STEPS} steps only {sorted(finals)} finished: the queue "
                         "stalled")


def test_a_host_hit_starts_at_once_behind_a_request_waiting_for_disk(tmp_path):
    model_dir, disk_dir = tmp_path / "model", tmp_path / "disk"
    hf = make_hf_model("llama", model_dir, max_position_embeddings=512)
    on_disk, in_host = random_prompts(2, PROMPT_LEN, seed=3)
    expected = hf_greedy(hf, [on_disk, in_host], MAX_TOKENS)
    first = _llm(str(model_dir), disk_dir)
    try:
        _generate(first, on_disk[:DISK_PREFIX_LEN])
    finally:
        first.engine.shutdown()
    llm = _llm(str(model_dir), disk_dir)  # a fresh host tier: on_disk's prefix is on disk only
    try:
        _generate(llm, in_host)
        assert llm.engine.reset_prefix_cache()  # in_host's KV is in host memory only
        finals = _run(llm.engine, {"on-disk": on_disk, "in-host": in_host})
        assert finals == {"on-disk": expected[0], "in-host": expected[1]}
        metrics = llm.get_metrics()
        assert metrics['kvtier:offload_tier_hits_total{tier="disk"}'] == 2
        llm.engine.check_invariants()
    finally:
        llm.engine.shutdown()
