"""P2PConnector on CUDA caches: the producer copies device blocks into its host payload and the
consumer copies the received payload back into device blocks (host buffers staged by torch's
copies). Same layout as on CPU, same tokens as HF's fp32 greedy. Run with `-m gpu`."""

from __future__ import annotations

import pytest
import torch

from kvtier.connector.p2p.layout import LayerMajorPayload
from tests.tiny_models import hf_greedy, make_block_prompts, make_hf_model
from tests.transport.p2p_helpers import MAX_TOKENS, engine_pair, hand_over, loaded_tokens

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


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


@pytest.mark.parametrize("push", ["layer", "request"])
def test_decode_on_cuda_with_the_producers_kv_matches_hf(tmp_path, push):
    prompts = make_block_prompts()
    expected = hf_greedy(make_hf_model("llama", str(tmp_path)), prompts, MAX_TOKENS)
    with engine_pair(str(tmp_path), device="cuda", push=push) as (producer, consumer):
        _, decodes = hand_over(producer, consumer, prompts)
        assert [d.outputs[0].token_ids for d in decodes] == expected
        assert [d.num_cached_tokens for d in decodes] == [loaded_tokens(p) for p in prompts]
        assert consumer.get_metrics()["kvtier:p2p_connector_blocks_loaded"] == 13
