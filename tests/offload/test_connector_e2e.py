"""OffloadingConnector end to end: a tiny random Llama whose device KV cache is too small for
the working set, checked token for token against HF transformers (fp32, greedy)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from kvtier import LLM, SamplingParams
from kvtier.engine import engine as engine_module

from ..tiny_models import hf_greedy, make_hf_model, random_prompts
from .offload_helpers import FAULTY_TIERS

PROMPT_LEN = 30  # 7 loadable blocks of 4 (the last token is always recomputed)
LOADABLE = 28
CHUNK_BYTES = 2 * 2 * 4 * 2 * 16 * 4  # layers * (K, V) * block * kv heads * head dim * fp32
MAX_TOKENS = 5
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
MAX_POSITIONS = 512
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    hf = make_hf_model("llama", directory, max_position_embeddings=MAX_POSITIONS)
    prompts = random_prompts(8, PROMPT_LEN)
    return str(directory), prompts, hf_greedy(hf, prompts, MAX_TOKENS)


def _llm(model_dir, **kwargs):
    # 24 device blocks hold 3 of the 8-block prompts: earlier ones get evicted from the device.
    return LLM(model_dir, dtype="float32", block_size=4, num_device_blocks=24, max_num_seqs=2,
               **kwargs)


def _generate(llm, prompts):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    return [o.outputs[0].token_ids for o in outputs], [o.num_cached_tokens for o in outputs]


def _tier(metrics, name, tier):
    return metrics.get(f'kvtier:offload_tier_{name}_total{{tier="{tier}"}}', 0.0)


def _generate_one_by_one(llm, prompts, expected):
    """Generate each prompt after the previous one's disk writes ended: a host slot being
    written out cannot take a new chunk (that store is skipped), which would leave older chunks
    in host memory and make the test depend on the disk's speed."""
    for prompt, want in zip(prompts, expected):
        assert _generate(llm, [prompt])[0] == [want]
        _wait_for_cascade(llm)


def _bytes(metrics, direction):
    return metrics.get(f'kvtier:offload_bytes_total{{direction="{direction}"}}', 0.0)


def test_chunks_longer_than_any_sequence_are_refused_at_start_up(model):
    # 128 blocks of 4 tokens: 512 tokens a chunk, past max_model_len (24 blocks hold 96 tokens).
    with pytest.raises(ValueError, match=r"blocks_per_chunk=128 makes chunks of 512 tokens, "
                                         r"longer than max_model_len=\d+: no sequence would"):
        _llm(model[0], kv_offload="host=1MiB,blocks_per_chunk=128")


def test_evicted_from_device_reloads_from_host(model):
    model_dir, prompts, expected = model
    llm = _llm(model_dir, kv_offload="host=1MiB")
    try:
        assert _generate(llm, prompts[:4]) == (expected[:4], [0, 0, 0, 0])
        tokens, cached = _generate(llm, prompts[:1])
        metrics = llm.get_metrics()
        assert tokens == expected[:1] and cached == [LOADABLE]
        assert _bytes(metrics, "host_to_device") == 7 * CHUNK_BYTES
        # 8 blocks of each prompt: 7 of the prompt, the 8th filled by decoding (30 + 4 tokens).
        assert _bytes(metrics, "device_to_host") == 4 * 8 * CHUNK_BYTES
        assert _tier(metrics, "hits", "host") >= 7
        llm.engine.check_invariants()
    finally:
        llm.engine.shutdown()


def _steps_to_first_token(llm, request_id, prompt):
    engine = llm.engine
    engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=1))
    for steps in range(1, 10):
        if any(out.outputs[0].token_ids for out in engine.step() if out.request_id == request_id):
            return steps
    raise AssertionError(f"{request_id} produced no token in 9 steps")


def test_a_host_hit_takes_as_many_steps_as_a_device_hit(model):
    """Chunks already in host memory are copied in the step that admits the request, before
    its forward: no step spent waiting for an asynchronous load."""
    model_dir, prompts, expected = model
    llm = _llm(model_dir, kv_offload="host=1MiB")
    try:
        _generate(llm, prompts[:1])
        device_hit = _steps_to_first_token(llm, "device", prompts[0])
        _generate(llm, prompts[1:4])  # pushes prompt 0 out of device memory
        host_hit = _steps_to_first_token(llm, "host", prompts[0])
        assert _bytes(llm.get_metrics(), "host_to_device") == 7 * CHUNK_BYTES
        assert host_hit == device_hit == 1
        assert _generate(llm, prompts[:1])[0] == expected[:1]
        llm.engine.check_invariants()
    finally:
        llm.engine.shutdown()


def _disk_tier_config(directory, **options):
    tier = {"type": "disk", "root_dir": str(directory), "max_bytes": 64 * 2**20, **options}
    return {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {
        "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 2**20,
        "secondary_tiers": [tier]}}


def _disk_maps(llm):
    return llm.engine.scheduler.connector.manager.tiers[0]._mapping is not None


def _restarted_on_disk(model_dir, prompt, directory, **options):
    """An engine on a disk tier a first engine wrote `prompt`'s chunks to, its start-up check
    done."""
    first = _llm(model_dir, kv_transfer_config=_disk_tier_config(directory, **options))
    try:
        _generate(first, [prompt])
        _wait_for_cascade(first)
    finally:
        first.engine.shutdown()
    llm = _llm(model_dir, kv_transfer_config=_disk_tier_config(directory, **options))
    checker = llm.engine.scheduler.connector.manager.tiers[0]._checker
    if checker is not None:
        checker.join(10)
    return llm


def test_a_disk_hit_takes_one_step_more_than_a_device_hit(model, tmp_path, monkeypatch):
    """The step that finds the chunks on disk starts their promotions and, with nothing else to
    compute, sleeps until they are in host memory; the next step takes them and admits."""
    model_dir, prompts, expected = model
    # An idle step's wait far longer than the promotions: only their end ends it.
    monkeypatch.setattr(engine_module, "IDLE_STEP_WAIT_S", 60.0)
    llm = _restarted_on_disk(model_dir, prompts[0], tmp_path, direct_loads=False)
    try:
        assert _steps_to_first_token(llm, "disk", prompts[0]) == 2
        assert _tier(llm.get_metrics(), "hits", "disk") == 7
        assert _steps_to_first_token(llm, "device", prompts[0]) == 1
        assert _generate(llm, prompts[:1])[0] == expected[:1]
    finally:
        llm.engine.shutdown()


def test_a_checked_disk_hit_in_memory_loads_from_the_file_in_one_step(model, tmp_path):
    """After a restart on a warm page cache the disk tier's checked chunks are loaded straight
    from its mapped file in the step that admits the request, as a host hit is."""
    model_dir, prompts, expected = model
    llm = _restarted_on_disk(model_dir, prompts[0], tmp_path)
    try:
        if not _disk_maps(llm):
            pytest.skip("no file mapping with residency checks here")
        assert _steps_to_first_token(llm, "disk", prompts[0]) == 1
        metrics = llm.get_metrics()
        assert _tier(metrics, "hits", "disk") == 7
        assert _bytes(metrics, "disk_to_device") == 7 * CHUNK_BYTES
        assert _bytes(metrics, "host_to_device") == _bytes(metrics, "disk_to_host") == 0
        assert _generate(llm, prompts[:1])[0] == expected[:1]
        # That device hit copied none of the chunks into host memory: the page cache has them.
        assert _bytes(llm.get_metrics(), "device_to_host") == 0
        assert not llm.engine.scheduler.connector.manager.tiers[0]._readers_of  # released
        llm.engine.check_invariants()
    finally:
        llm.engine.shutdown()


def test_a_failed_copy_from_the_mapped_file_is_recomputed(model, tmp_path, monkeypatch):
    model_dir, prompts, expected = model
    llm = _restarted_on_disk(model_dir, prompts[0], tmp_path)
    try:
        tier = llm.engine.scheduler.connector.manager.tiers[0]
        if tier._mapping is None:
            pytest.skip("no file mapping with residency checks here")
        copier = llm.engine.runner.connector._copier

        def fail_mapped(transfers):
            if any(transfer.mapped is not None for transfer in transfers):
                raise OSError("the copy from the mapped file failed")
            return type(copier).host_to_device(copier, transfers)

        monkeypatch.setattr(copier, "host_to_device", fail_mapped)
        assert _generate(llm, prompts[:1])[0] == expected[:1]
        metrics = llm.get_metrics()
        assert _tier(metrics, "hits", "disk") == 7  # found and mapped, then recomputed
        assert _bytes(metrics, "disk_to_device") == 0
        assert _tier(metrics, "errors", "disk") == 1  # one failed batch
        assert not tier._readers_of  # its pins released
        # Out of the device again: the disk tier is not asked for those chunks for a while, so
        # the prompt is recomputed instead of failing the same copy once more.
        assert llm.engine.reset_prefix_cache()
        assert _generate(llm, prompts[:1])[0] == expected[:1]
        assert _tier(llm.get_metrics(), "errors", "disk") == 1
        llm.engine.check_invariants()
    finally:
        llm.engine.shutdown()

def test_multi_block_chunks_reload_whole_chunks_only(model):
    model_dir, prompts, expected = model
    llm = _llm(model_dir, kv_offload="host=1MiB,blocks_per_chunk=2,policy=arc")
    try:
        assert _generate(llm, prompts[:4])[0] == expected[:4]
        tokens, cached = _generate(llm, prompts[:1])
        # 7 loadable blocks make 3 whole 2-block chunks: 24 tokens load, the rest recompute.
        assert tokens == expected[:1] and cached == [24]
        assert _bytes(llm.get_metrics(), "host_to_device") == 6 * CHUNK_BYTES
    finally:
        llm.engine.shutdown()


# The flag that puts each file-backed tier in a directory.
_TIER_FLAGS = {"disk": "disk={}:64MiB", "fs": "fs={}"}


@pytest.mark.parametrize("tier", ["disk", "fs"])
def test_evicted_from_host_reloads_from_disk(model, tmp_path, tier):
    model_dir, prompts, expected = model
    # 16 host chunks: two prompts' worth, so the first prompts leave host memory too.
    llm = _llm(model_dir, kv_offload=f"host={16 * CHUNK_BYTES},"
                                     f"{_TIER_FLAGS[tier].format(tmp_path)}")
    try:
        _generate_one_by_one(llm, prompts, expected)
        tokens, cached = _generate(llm, prompts[:2])
        metrics = llm.get_metrics()
        assert tokens == expected[:2] and cached == [LOADABLE, LOADABLE]
        # 14 chunks must come from disk. A lookup can find a chunk while every host slot is
        # still protected by an in-flight store; it is then asked again, so under load the
        # counts may exceed 14 (timing), never fall short.
        assert _tier(metrics, "hits", tier) >= 14
        # The disk tier's chunks, stored by this process and in the page cache, go straight
        # from its mapped file into the device; the fs tier's through host memory.
        moved = f"{tier}_to_device" if tier == "disk" and _disk_maps(llm) else f"{tier}_to_host"
        assert _bytes(metrics, moved) >= 14 * CHUNK_BYTES
        assert _tier(metrics, "errors", tier) == 0
    finally:
        llm.engine.shutdown()


def test_write_back_leaves_the_disk_alone_while_the_host_holds_the_working_set(model, tmp_path):
    model_dir, prompts, expected = model
    llm = _llm(model_dir, kv_offload=f"host=1MiB,fs={tmp_path},write=back")
    try:
        assert _generate(llm, prompts)[0] == expected
        tokens, cached = _generate(llm, prompts[:2])  # evicted from the device: from host
        metrics = llm.get_metrics()
        assert tokens == expected[:2] and cached == [LOADABLE, LOADABLE]
        assert _bytes(metrics, "host_to_fs") == 0
        # At least the 7 prompt chunks of each of the 8 prompts (output blocks may follow).
        dirty = metrics["kvtier:offload_host_dirty_chunks"]
        assert dirty >= 8 * LOADABLE // 4
        assert not any(names for _, _, names in os.walk(tmp_path))
        assert metrics["kvtier:offload_writeback_dropped_total"] == 0
    finally:
        llm.engine.shutdown()
    files = [name for _, _, names in os.walk(tmp_path) for name in names]
    assert len(files) >= dirty  # shutdown wrote them (a restart reads them: test below)


_SECOND_INSTANCE = textwrap.dedent("""
    import json
    from kvtier import LLM, SamplingParams
    llm = LLM({model!r}, dtype="float32", block_size=4, num_device_blocks=24, max_num_seqs=2,
              kv_offload="host=1MiB,{tier_flag}")
    params = SamplingParams(temperature=0.0, max_tokens={max_tokens}, ignore_eos=True)
    outs = llm.generate([{{"prompt_token_ids": p}} for p in {prompts!r}], params)
    m = llm.get_metrics()
    print(json.dumps([[o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs],
                      m.get('kvtier:offload_tier_hits_total{{tier="{tier}"}}', 0)]))
    llm.engine.shutdown()
""")


@pytest.mark.parametrize("write, tier", [("through", "fs"), ("back", "disk")])
def test_second_process_on_the_same_disk_gets_disk_hits(model, tmp_path, write, tier):
    model_dir, prompts, expected = model
    tier_flag = _TIER_FLAGS[tier].format(tmp_path)
    # 1 MiB of host memory holds every chunk: under write_back nothing is written before
    # shutdown, which writes it all.
    llm = _llm(model_dir, kv_offload=f"host=1MiB,{tier_flag},write={write}")
    try:
        assert _generate(llm, prompts[:3])[0] == expected[:3]
    finally:
        llm.engine.shutdown()  # waits for the cascade to disk
    script = _SECOND_INSTANCE.format(model=model_dir, tier_flag=tier_flag, tier=tier,
                                     max_tokens=MAX_TOKENS, prompts=prompts[:3])
    # In the repository root, `python -c` imports kvtier as this process does.
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    tokens, cached, tier_hits = eval(out.stdout.strip().splitlines()[-1])
    assert tokens == expected[:3]
    assert cached == [LOADABLE] * 3
    assert tier_hits == 21


def _damage_files(directory, how):
    paths = [os.path.join(root, name) for root, _, names in os.walk(directory)
             for name in names if name.endswith(".kvc")]
    assert paths, "nothing reached the disk tier"
    for path in paths:
        if how == "delete":
            os.unlink(path)
        elif how == "truncate":
            os.truncate(path, os.path.getsize(path) // 2)
        else:
            with open(path, "r+b") as f:
                f.seek(-1, os.SEEK_END)
                last = f.read(1)[0]
                f.seek(-1, os.SEEK_END)
                f.write(bytes([last ^ 0x5A]))


# Deleted files fail their loads too: the fs tier answers lookups from what it stored (a stat
# per lookup would run on the engine thread), until its memory of them expires.
@pytest.mark.parametrize("how, num_errors", [("corrupt", 14), ("truncate", 14), ("delete", 14)])
def test_damaged_disk_files_fall_back_to_recompute(model, tmp_path, how, num_errors):
    model_dir, prompts, expected = model
    llm = _llm(model_dir, kv_offload=f"host={16 * CHUNK_BYTES},fs={tmp_path}")
    try:
        _generate_one_by_one(llm, prompts, expected)
        _damage_files(tmp_path, how)
        assert _generate(llm, prompts[:2]) == (expected[:2], [0, 0])
        metrics = llm.get_metrics()
        # All 7 chunks of both prompts are found and promoted at once, every load fails its
        # check, and the requests recompute.
        assert _tier(metrics, "errors", "fs") == num_errors
        assert _tier(metrics, "hits", "fs") == num_errors
        llm.engine.check_invariants()
    finally:
        llm.engine.shutdown()


def _wait_for_cascade(llm):
    # One more (empty) step: the worker half fences the last step's copies and reports them.
    llm.engine.step()
    assert llm.engine.scheduler.connector.flush(timeout_s=30), "cascade to the tiers hangs"


def test_broken_tier_costs_errors_not_output(model):
    model_dir, prompts, expected = model
    # (A read-only fs tier is no failure: its stores are skipped, tests/offload/test_fs_safety.py.)
    tier = {"type": "RaisingTier", "module_path": FAULTY_TIERS}
    config = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {
        "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 16 * CHUNK_BYTES,
        "secondary_tiers": [tier]}}
    llm = _llm(model_dir, kv_transfer_config=config)
    try:
        assert _generate(llm, prompts)[0] == expected
        _wait_for_cascade(llm)
        assert _generate(llm, prompts[:2]) == (expected[:2], [0, 0])
        _wait_for_cascade(llm)
        metrics = llm.get_metrics()
        # Every chunk that reached host memory went on to the tier and failed there. (Not a
        # fixed count: under CPU load a store finding every host slot pinned by a cascade is
        # skipped, so fewer than all 8 x 7 chunks may reach host memory.)
        in_host = _bytes(metrics, "device_to_host") / CHUNK_BYTES
        assert in_host >= 7
        assert _tier(metrics, "errors", tier["type"]) >= in_host
        assert _bytes(metrics, f"host_to_{tier['type']}") == 0
        assert _tier(metrics, "hits", tier["type"]) == 0
    finally:
        llm.engine.shutdown()


def test_sliding_window_group_reloads_only_its_window(tmp_path):
    hf = make_hf_model("mistral", tmp_path, sliding_window=6,
                       max_position_embeddings=MAX_POSITIONS)
    prompts = random_prompts(4, PROMPT_LEN, seed=1)
    expected = hf_greedy(hf, prompts, MAX_TOKENS)
    llm = _llm(str(tmp_path), kv_offload="host=1MiB")
    try:
        assert _generate(llm, prompts)[0] == expected
        tokens, cached = _generate(llm, prompts[:2])
        assert tokens == expected[:2] and cached == [LOADABLE, LOADABLE]
        # The window (6 tokens) ending at token 28 reaches back into 2 blocks; the other 5
        # positions hold the null block on the device and are not loaded.
        assert _bytes(llm.get_metrics(), "host_to_device") == 2 * 2 * CHUNK_BYTES
    finally:
        llm.engine.shutdown()


_HUNG_TIER_INSTANCE = textwrap.dedent("""
    import json, time
    from kvtier import LLM, SamplingParams
    config = {{"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {{
        "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1 << 20,
        "tier_job_timeout_s": {deadline},
        "secondary_tiers": [{{"type": "HangingTier", "module_path": {faulty!r}}}]}}}}
    llm = LLM({model!r}, dtype="float32", block_size=4, num_device_blocks=24, max_num_seqs=2,
              kv_transfer_config=config)
    params = SamplingParams(temperature=0.0, max_tokens={max_tokens}, ignore_eos=True)
    outs = llm.generate([{{"prompt_token_ids": p}} for p in {prompts!r}], params)
    start = time.monotonic()
    llm.engine.shutdown()
    print(json.dumps([[o.outputs[0].token_ids for o in outs], time.monotonic() - start]))
""")


def test_shutdown_with_a_hung_tier_ends_by_its_deadline_and_the_process_exits(model):
    model_dir, prompts, expected = model
    deadline = 1
    script = _HUNG_TIER_INSTANCE.format(model=model_dir, faulty=FAULTY_TIERS, deadline=deadline,
                                        max_tokens=MAX_TOKENS, prompts=prompts[:2])
    # Every store to the tier blocks forever: the process must still shut down and exit.
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    tokens, shutdown_s = json.loads(out.stdout.strip().splitlines()[-1])
    assert tokens == expected[:2]
    assert shutdown_s < deadline + 5
    assert "abandoned" in out.stderr  # the stuck write threads, logged once
