"""Random PEFT LoRA adapters on the tiny test models, saved as PEFT saves them, with the
PeftModel that is their reference."""

from __future__ import annotations

import copy

import peft
import torch

ALL_LLAMA = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(base, directory, seed: int, targets=ALL_LLAMA, r: int = 4, alpha: int = 8,
                 **config):
    """Save a LoRA adapter of `base` (a tiny HF model, left as it is) with random A and B into
    `directory`; return the PeftModel in eval mode."""
    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
        r=r, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False,
        **config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                # Large enough that every adapter changes the greedy tokens.
                param.normal_(0.0, 0.3)
    model.save_pretrained(str(directory))
    return model.eval()
