"""bf16 projections packed for oneDNN compute what F.linear computes; kvtier's AMX kernel
computes the exact products summed in fp32 (where the CPU has AMX); only bf16 CPU models are
packed."""

import random

import pytest
import torch
import torch.nn.functional as F

from kvtier.models import load_model
from kvtier.models.llama import LlamaForCausalLM
from kvtier.models.packed_linear import (
    AMX_MAX_ROWS,
    PackedLinear,
    amx_kernels,
    can_pack,
    pack_for_amx,
)

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


needs_amx = pytest.mark.skipif(amx_kernels() is None, reason="no AMX bf16 tiles on this CPU")


@needs_amx
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 33, 64, 100, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_linear_sums_exact_products_in_fp32(rows, with_bias):
    # 37 column blocks: 19 pairs, the last one alone, more than one group of pairs per thread.
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(37 * 16, 96, generator=generator).bfloat16()
    bias = torch.randn(37 * 16, generator=generator).bfloat16() if with_bias else None
    x = torch.randn(rows, 96, generator=generator).bfloat16()
    out = amx_kernels().amx_linear(x, pack_for_amx(weight), bias)
    reference = x.double() @ weight.double().t()
    if bias is not None:
        reference += bias.double()
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 37 * 16)
    # Only the final rounding to bf16 (a relative 2^-9) and fp32 sums stand between them.
    torch.testing.assert_close(out.double(), reference, rtol=2 ** -8, atol=1e-4)


@needs_amx
def test_amx_linear_rejects_mismatched_shapes():
    kernels = amx_kernels()
    packed = pack_for_amx(torch.ones(32, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="x has 96 columns"):
        kernels.amx_linear(torch.ones(2, 96, dtype=torch.bfloat16), packed, None)
    with pytest.raises(RuntimeError, match="bias has 3 values"):
        kernels.amx_linear(torch.ones(2, 64, dtype=torch.bfloat16), packed,
                           torch.ones(3, dtype=torch.bfloat16))


@needs_amx
@pytest.mark.parametrize("rows", [3, AMX_MAX_ROWS, AMX_MAX_ROWS + 1])
def test_auto_packing_runs_both_kernels_and_matches_f_linear(rows):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(64, 64, generator=generator).bfloat16()
    x = torch.randn(rows, 64, generator=generator).bfloat16()
    packed = PackedLinear(weight, None)
    assert packed.amx is not None and packed.packed is not None
    out = packed(x.reshape(1, rows, 64))
    assert out.shape == (1, rows, 64)
    torch.testing.assert_close(out[0], F.linear(x, weight), rtol=2 ** -7, atol=1e-3)


def test_kernel_choice_is_checked():
    with pytest.raises(ValueError, match="kernel must be"):
        PackedLinear(torch.ones(16, 32, dtype=torch.bfloat16), None, "fast")
    with pytest.raises(ValueError, match="no AMX linear for a 96x40 weight"):
        PackedLinear(torch.ones(96, 40, dtype=torch.bfloat16), None, "amx")


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
