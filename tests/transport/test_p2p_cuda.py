"""P2PConnector on CUDA caches: the producer copies device blocks into its host payload and the
consumer copies the received payload back into device blocks (host buffers staged by torch's
copies). Same layout as on CPU, same tokens as HF's fp32 greedy. Run with `-m gpu`."""

from __future__ import annotations

import pytest
import torch

from kvtier import LLM, SamplingParams
from kvtier.connector.p2p.layout import LayerMajorPayload
from tests.tiny_models import hf_greedy, make_block_prompts, make_hf_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BLOCK_SIZE = 4
MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
PREFILL = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def test_payload_of_cuda_caches_matches_the_cpu_layout():
    torch.manual_seed(0)
    cpu = {"l0": torch.randn(2, 8, 4, 2, 3, dtype=torch.bfloat16),
           "l1": torch.randn(2, 8, 4, 1, 5, dtype=torch.bfloat16)}
    cuda = {name: cache.cuda() for name, cache in cpu.items()}
    cpu_payload, cuda_payload = LayerMajorPayload(cpu, 3), LayerMajorPayload(cuda, 3)
    for i, name in enumerate(cpu):
        cpu_payload.copy_out(i, 0, cpu[name], [6, 5, 2])
        cuda_payload.copy_out(i, 0, cuda[name], [6, 5, 2])
    assert torch.equal(cpu_payload.buffer, cuda_payload.buffer)
    target = {name: torch.zeros_like(cache) for name, cache in cuda.items()}
    for i, name in enumerate(target):
        cuda_payload.copy_in(i, 1, target[name], [0, 7])
        assert target[name].is_cuda
        assert torch.equal(target[name][:, [0, 7]].cpu(), cpu[name][:, [5, 2]])


def _llm(model_dir: str, role: str, push: str) -> LLM:
    extra = {"send_timeout_s": 5.0, "push": push} if role == "kv_producer" else {}
    return LLM(model_dir, dtype="float32", device="cuda", block_size=BLOCK_SIZE,
               num_device_blocks=64,
               kv_transfer_config={"kv_connector": "P2PConnector", "kv_role": role,
                                   "kv_connector_extra_config": extra})


def _run(llm: LLM, request_id: str, prompt, params, kv_transfer_params):
    llm.engine.add_request(request_id, prompt, params, kv_transfer_params=kv_transfer_params)
    for _ in range(10_000):
        for output in llm.engine.step():
            if output.request_id == request_id and output.finished:
                return output
    raise AssertionError(f"{request_id} did not finish")


@pytest.mark.parametrize("push", ["layer", "request"])
def test_decode_on_cuda_with_the_producers_kv_matches_hf(tmp_path, push):
    prompts = make_block_prompts()
    expected = hf_greedy(make_hf_model("llama", str(tmp_path)), prompts, MAX_TOKENS)
    producer, consumer = _llm(str(tmp_path), "kv_producer", push), _llm(str(tmp_path),
                                                                        "kv_consumer", push)
    try:
        address = consumer.engine.runner.connector.address
        tokens, cached = [], []
        for i, prompt in enumerate(prompts):
            prefill = _run(producer, f"p{i}", prompt, PREFILL,
                           {"transfer_id": f"t{i}", "consumer_address": address})
            producer.engine.step()
            decode = _run(consumer, f"c{i}", prompt, GREEDY, prefill.kv_transfer_params)
            tokens.append(decode.outputs[0].token_ids)
            cached.append(decode.num_cached_tokens)
        assert tokens == expected
        assert cached == [(len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in prompts]
        assert consumer.get_metrics()["kvtier:p2p_connector_blocks_loaded"] == 13
    finally:
        for llm in (producer, consumer):
            llm.engine.shutdown()
