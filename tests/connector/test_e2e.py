"""End to end on a tiny random Llama: KV saved by one process is loaded by a fresh one.

Process A (this one) generates with ExampleConnector saving every full block; process B (a
subprocess) runs the same prompts against the same directory and must load all but the last
block of each prompt, with A's tokens. Then the same through out-of-tree connectors loaded with
kv_connector_module_path: one that reports loaded blocks invalid (under both failure policies),
and one that records the per-layer hooks.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("kvtier.engine.llm",
                    reason="the engine (kvtier/engine/llm.py) is not built yet")

from kvtier import LLM, SamplingParams  # noqa: E402
from kvtier.connector.example import BlockFiles  # noqa: E402
from kvtier.kv.hashing import make_block_hasher  # noqa: E402
from kvtier.kv.request import Request  # noqa: E402

from ..tiny_models import hf_greedy, make_block_prompts, make_hf_model  # noqa: E402
from . import kvtier_test_connectors as plugins  # noqa: E402
from .connector_testing import BLOCK_SIZE, MAX_TOKENS, PLUGINS  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def example_config(store, **fields):
    return {"kv_connector": "ExampleConnector",
            "kv_connector_extra_config": {"shared_storage_path": str(store)}, **fields}


def generate(llm, prompts):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    llm.engine.check_invariants()
    return [out.outputs[0].token_ids for out in outputs]


def generate_in_fresh_process(model_dir, transfer_configs, prompts):
    """One result dict per transfer config, from one new Python process."""
    # -m from the repository root: kvtier and the tests package import as they do here.
    result = subprocess.run(
        [sys.executable, "-m", "tests.connector.generate_once", model_dir,
         json.dumps(transfer_configs), json.dumps(prompts), str(MAX_TOKENS), str(BLOCK_SIZE)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Process A's run: (model dir, prompts, A's tokens, store directory)."""
    model_dir = str(tmp_path_factory.mktemp("model"))
    prompts = make_block_prompts()
    expected = hf_greedy(make_hf_model("llama", model_dir), prompts, MAX_TOKENS)
    store = tmp_path_factory.mktemp("store")
    llm = LLM(model_dir, dtype="float32", block_size=BLOCK_SIZE, num_device_blocks=64,
              kv_transfer_config=example_config(store))
    tokens = generate(llm, prompts)
    namespace = llm.engine.runtime.namespace
    llm.engine.shutdown()  # waits for the last writes
    assert tokens == expected
    return model_dir, prompts, tokens, store, namespace


def test_process_a_writes_one_file_per_computed_full_block(saved):
    _, prompts, tokens, store, namespace = saved
    hasher = make_block_hasher(BLOCK_SIZE)
    expected = set()
    for prompt, output in zip(prompts, tokens):
        # The last sampled token is never fed back, so its KV is never computed.
        computed = Request("r", prompt + output[:-1], block_hasher=hasher)
        expected |= {block_hash.hex() + ".kv" for block_hash in computed.block_hashes}
    assert len(expected) == 21
    # And the description of the namespace, for operators.
    expected.add(namespace.hex() + ".json")
    assert set(os.listdir(BlockFiles(str(store), namespace).directory)) == expected


def _flip_last_byte(path):
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last ^ 0x01]))


def test_damaged_files_are_recomputed_with_counted_errors(saved, tmp_path):
    model_dir, prompts, tokens, store, namespace = saved
    copy = shutil.copytree(store, tmp_path / "store")
    files = BlockFiles(str(copy), namespace)
    hasher = make_block_hasher(BLOCK_SIZE)
    # Prompts 1 and 3 share no block with another prompt: each damaged file is read once.
    second = Request("1", prompts[1], block_hasher=hasher).block_hashes
    fourth = Request("3", prompts[3], block_hasher=hasher).block_hashes
    _flip_last_byte(files.path(second[1]))  # a payload byte
    path = files.path(fourth[2])
    os.truncate(path, os.path.getsize(path) - 1)
    llm = LLM(model_dir, dtype="float32", block_size=BLOCK_SIZE, num_device_blocks=64,
              kv_transfer_config=example_config(copy, kv_role="kv_consumer"))
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        metrics = llm.get_metrics()
        llm.engine.check_invariants()
    finally:
        llm.engine.shutdown()
    assert [out.outputs[0].token_ids for out in outputs] == tokens
    # Only the blocks before each damaged one stay loaded; the rest is computed here.
    assert [out.num_cached_tokens for out in outputs] == [16, 4, 12, 8, 4]
    assert metrics["kvtier:example_connector_load_errors"] == 2
    assert metrics["kvtier:example_connector_blocks_loaded"] == 14
    # Dropped, so that a later save writes good copies.
    assert not os.path.exists(files.path(second[1])) and not os.path.exists(path)


def faulty_config(store, policy):
    return {"kv_connector": "FaultyLoadConnector",
            "kv_connector_module_path": PLUGINS, "kv_role": "kv_consumer",
            "kv_load_failure_policy": policy,
            "kv_connector_extra_config": {"shared_storage_path": str(store)}}


@pytest.fixture(scope="module")
def loaded(saved):
    """Process B's runs (one fresh process; torch starts once): ExampleConnector, then the
    faulty connector under "recompute", then under "fail"."""
    model_dir, prompts, _, store, _ = saved
    configs = [example_config(store, kv_role="kv_consumer"), faulty_config(store, "recompute"),
               faulty_config(store, "fail")]
    return dict(zip(["example", "recompute", "fail"],
                    generate_in_fresh_process(model_dir, configs, prompts)))


def test_a_fresh_process_loads_all_but_the_last_block(saved, loaded):
    _, prompts, tokens, _, _ = saved
    result = loaded["example"]
    assert result["token_ids"] == tokens
    assert [len(p) for p in prompts] == [19, 16, 13, 23, 6]
    # At most one block of prefill is computed per prompt: the one with its last token.
    assert result["num_cached_tokens"] == [16, 12, 12, 20, 4]
    assert result["metrics"]["kvtier:example_connector_blocks_loaded"] == 16
    assert result["metrics"]["kvtier:example_connector_load_errors"] == 0
    assert result["metrics"]["vllm:prefix_cache_hits"] == 0


def test_invalid_blocks_are_recomputed_under_recompute(saved, loaded):
    tokens, result = saved[2], loaded["recompute"]
    # Every prompt that loaded two blocks or more had its second block scribbled over.
    assert result["metrics"]["kvtier_test:blocks_reported_invalid"] == 4
    assert result["token_ids"] == tokens
    assert result["finish_reasons"] == ["length"] * 5


def test_invalid_blocks_end_the_request_with_an_error_under_fail(saved, loaded):
    tokens, result = saved[2], loaded["fail"]
    assert result["metrics"]["kvtier_test:blocks_reported_invalid"] == 4
    assert result["finish_reasons"] == ["error"] * 4 + ["length"]
    assert result["token_ids"] == [[], [], [], [], tokens[4]]
    assert result["errors"][:4] == [
        f"KV load failed for request '{i}': the block at token 4 arrived invalid "
        "(kv_load_failure_policy='fail'; use 'recompute' to compute it locally instead)"
        for i in range(4)]
    assert result["errors"][4] is None


def test_layer_hooks_see_every_layer_in_order_every_step(saved):
    model_dir, prompts, tokens, _, _ = saved
    plugins.RECORDED_STEPS.clear()
    llm = LLM(model_dir, dtype="float32", block_size=BLOCK_SIZE, num_device_blocks=64,
              max_num_batched_tokens=32, kv_transfer_config={
                  "kv_connector": "RecordingConnector",
                  "kv_connector_module_path": PLUGINS})
    assert generate(llm, prompts) == tokens
    llm.engine.shutdown()
    steps = plugins.RECORDED_STEPS
    layers = [f"model.layers.{i}.self_attn" for i in range(2)]
    per_step = [call for layer in layers
                for call in (("wait_for_layer_load", layer), ("save_kv_layer", layer))]
    assert [step["step"] for step in steps] == list(range(1, len(steps) + 1))
    # 77 prompt tokens in chunks of at most 32, then decode: every step runs the model.
    assert len(steps) >= MAX_TOKENS + 2
    assert all(step["num_scheduled_tokens"] > 0 for step in steps)
    assert [step["calls"] for step in steps] == [per_step] * len(steps)


def test_a_connector_that_never_decides_is_dropped_at_the_lookup_deadline(saved):
    model_dir, prompts, tokens, _, _ = saved
    llm = LLM(model_dir, dtype="float32", block_size=BLOCK_SIZE, num_device_blocks=64,
              kv_transfer_config={"kv_connector": "UndecidedConnector",
                                  "kv_connector_module_path": PLUGINS, "kv_load_timeout_s": 1})
    start = time.monotonic()
    try:
        # Each request waits out one deadline of "not yet", then computes its prompt itself.
        assert generate(llm, prompts[:2]) == tokens[:2]
        elapsed = time.monotonic() - start
        assert 1.0 < elapsed < 1.0 + 10.0
        assert llm.get_metrics()["kvtier:connector_lookup_timeouts_total"] == 2
    finally:
        llm.engine.shutdown()
