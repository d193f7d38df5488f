"""LoRA on a CUDA device: the same tokens as on the CPU (fp32), several adapters and the base
model in one batch, both the stacked and the per-adapter paths. The adapters are written here
in PEFT's file format without PEFT (a CUDA image need not have it); the CPU path is checked
against PEFT itself in test_lora_generation.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from kvtier import LLM, LoRARequest, SamplingParams
from tests.tiny_models import BASE_CONFIG, make_hf_model, make_prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def write_adapter(directory, seed: int, rank: int) -> str:
    """A random rank-`rank` adapter of every projection of the tiny Llama, as PEFT saves one."""
    hidden, inter = BASE_CONFIG["hidden_size"], BASE_CONFIG["intermediate_size"]
    head_dim = hidden // BASE_CONFIG["num_attention_heads"]
    kv = BASE_CONFIG["num_key_value_heads"] * head_dim
    shapes = {"self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (hidden, kv),
              "self_attn.v_proj": (hidden, kv), "self_attn.o_proj": (hidden, hidden),
              "mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter),
              "mlp.down_proj": (inter, hidden)}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(BASE_CONFIG["num_hidden_layers"]):
        for module, (fan_in, fan_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in,
                                                             generator=generator) * 0.3
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank,
                                                             generator=generator) * 0.3
    directory.mkdir()
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": [m.split(".")[1] for m in shapes]}))
    return str(directory)


def test_adapters_on_cuda_match_the_cpu(tmp_path):
    make_hf_model("llama", tmp_path / "base")
    requests = [None, LoRARequest("a", 1, write_adapter(tmp_path / "a", 1, 4)),
                LoRARequest("b", 2, write_adapter(tmp_path / "b", 2, 8))]
    prompts = [p for p in make_prompts() for _ in range(3)]
    loras = requests * (len(prompts) // 3)
    outputs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(str(tmp_path / "base"), dtype="float32", block_size=4, device=device,
                  enable_lora=True, max_loras=2, max_num_batched_tokens=64)
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                               lora_request=loras)
        outputs[device] = [r.outputs[0].token_ids for r in results]
        llm.engine.check_invariants()
        llm.shutdown()
    assert outputs["cuda"] == outputs["cpu"]
