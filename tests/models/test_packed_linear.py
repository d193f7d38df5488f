"""bf16 projections packed for oneDNN compute what F.linear computes, and only bf16 CPU models
are packed."""

import random

import pytest
import torch
import torch.nn.functional as F

from kvtier.models import load_model
from kvtier.models.llama import LlamaForCausalLM
from kvtier.models.packed_linear import PackedLinear, can_pack

from ..tiny_models import VOCAB
from .helpers import PagedDriver

pytestmark = pytest.mark.skipif(not can_pack(torch.empty(1, dtype=torch.bfloat16)),
                                reason="no oneDNN bf16 kernels on this CPU")


@pytest.mark.parametrize("rows", [1, 5, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_equals_f_linear(rows, with_bias):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=generator).bfloat16()
    bias = torch.randn(96, generator=generator).bfloat16() if with_bias else None
    x = torch.randn(rows, 40, generator=generator).bfloat16()
    packed = PackedLinear(weight, bias)
    torch.testing.assert_close(packed(x), F.linear(x, weight, bias), atol=0, rtol=0)


def test_bf16_model_packs_every_projection_and_keeps_its_logits(model_pair, tmp_path,
                                                                monkeypatch):
    hf_model, _ = model_pair
    hf_model.save_pretrained(tmp_path)
    packed = load_model(str(tmp_path), dtype=torch.bfloat16).model
    monkeypatch.setattr(LlamaForCausalLM, "pack_weights", lambda self: None)
    plain = load_model(str(tmp_path), dtype=torch.bfloat16).model

    num_layers = packed.config.num_layers
    packed_modules = [m for m in packed.modules() if isinstance(m, PackedLinear)]
    assert len(packed_modules) == 4 * num_layers + 1  # qkv, o, gate_up, down; the logits head
    assert packed.logits_head is not None and packed.lm_head is None
    assert not any(isinstance(m, torch.nn.Linear) for m in packed.modules())

    prompt = [random.Random(3).randrange(3, VOCAB) for _ in range(11)]
    torch.testing.assert_close(PagedDriver(packed).step({0: prompt})[0],
                               PagedDriver(plain).step({0: prompt})[0], atol=0, rtol=0)


def test_fp32_model_is_not_packed(model_pair):
    _, loaded = model_pair
    assert not any(isinstance(m, PackedLinear) for m in loaded.model.modules())
    assert loaded.model.logits_head is None
