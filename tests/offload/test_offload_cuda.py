"""Tiered offloading with the KV cache on a CUDA device: chunks go device -> host on the copy
stream, and come back from host memory, from a disk tier's mapped file (straight into the
device) and through host memory after a restart, token for token as HF transformers (fp32,
greedy). The same flows run on CPU in test_connector_e2e.py and test_hybrid_e2e.py. Run with
`-m gpu`."""

import pytest
import torch

from kvtier import LLM, SamplingParams

from ..tiny_models import hf_greedy, make_hf_model, make_lfm2_model, random_prompts
from .offload_helpers import flushed, generate, offload_bytes

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPT_LEN = 30  # 7 loadable blocks of 4 (the last token is always recomputed)
LOADABLE = 28
MAX_TOKENS = 5
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
CHUNK_BYTES = 2 * 2 * 4 * 2 * 16 * 4  # layers * (K, V) * block * kv heads * head dim * fp32


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    hf = make_hf_model("llama", directory, max_position_embeddings=512)
    prompts = random_prompts(8, PROMPT_LEN)
    return str(directory), prompts, hf_greedy(hf, prompts, MAX_TOKENS)


def _llm(model_dir, num_device_blocks=24, **kwargs):
    # 24 device blocks hold 3 of the 8-block Llama prompts: earlier ones get evicted.
    return LLM(model_dir, dtype="float32", block_size=4, num_device_blocks=num_device_blocks,
               max_num_seqs=2, device="cuda", **kwargs)


def _generate(llm, prompts):
    return generate(llm, prompts, PARAMS)


def test_evicted_from_device_reloads_from_host_on_cuda(llama):
    model_dir, prompts, expected = llama
    llm = _llm(model_dir, kv_offload="host=1MiB")
    try:
        assert llm.engine.runner.connector._copier.stream is not None  # the side stream
        assert _generate(llm, prompts[:4]) == (expected[:4], [0, 0, 0, 0])
        assert _generate(llm, prompts[:1]) == (expected[:1], [LOADABLE])
        assert offload_bytes(llm, "host_to_device") == 7 * CHUNK_BYTES
        assert offload_bytes(llm, "device_to_host") == 4 * 8 * CHUNK_BYTES
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("direct_loads", [True, False])
def test_a_restart_on_a_disk_tier_loads_its_chunks_into_cuda_blocks(llama, tmp_path,
                                                                    direct_loads):
    model_dir, prompts, expected = llama
    tiers = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {
        "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 2**20,
        "secondary_tiers": [{"type": "disk", "root_dir": str(tmp_path), "max_bytes": 2**26,
                             "direct_loads": direct_loads}]}}
    first = _llm(model_dir, kv_transfer_config=tiers)
    try:
        _generate(first, prompts[:1])
        flushed(first)
    finally:
        first.engine.shutdown()
    llm = _llm(model_dir, kv_transfer_config=tiers)
    try:
        tier = llm.engine.scheduler.connector.manager.tiers[0]
        if tier._checker is not None:
            tier._checker.join(10)
        assert _generate(llm, prompts[:1]) == (expected[:1], [LOADABLE])
        mapped = direct_loads and tier._mapping is not None
        moved = "disk_to_device" if mapped else "disk_to_host"
        assert offload_bytes(llm, moved) == 7 * CHUNK_BYTES
    finally:
        llm.engine.shutdown()


def test_hybrid_conv_states_reload_from_host_on_cuda(tmp_path):
    hf = make_lfm2_model("attn_conv_conv", tmp_path, max_position_embeddings=512)
    prompts = random_prompts(8, PROMPT_LEN)
    expected = hf_greedy(hf, prompts, MAX_TOKENS)
    # 48 blocks hold 3 prompts in both groups (attention and conv states).
    llm = _llm(str(tmp_path), num_device_blocks=48, kv_offload="host=4MiB")
    try:
        assert _generate(llm, prompts[:4]) == (expected[:4], [0, 0, 0, 0])
        assert _generate(llm, prompts[:1]) == (expected[:1], [LOADABLE])
        assert offload_bytes(llm, "host_to_device") > 0
    finally:
        llm.engine.shutdown()
