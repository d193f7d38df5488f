"""The parity checks on CUDA (skipped without a GPU; run with -m gpu)."""

import random

import pytest
import torch

from kvtier.models import load_model

from ..tiny_models import ARCHS, VOCAB
from .helpers import PagedDriver, hf_logits, make_covering_hf_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_prefill_chunks_and_decode_match_hf_on_cuda(arch, tmp_path):
    hf_model = make_covering_hf_model(arch, tmp_path)
    loaded = load_model(str(tmp_path), dtype=torch.float32, device="cuda")
    rng = random.Random(0)
    prompt = [rng.randrange(3, VOCAB) for _ in range(14)]
    driver = PagedDriver(loaded.model)
    logits = torch.cat([driver.step({0: prompt[:6]})[0], driver.step({0: prompt[6:]})[0]])
    torch.testing.assert_close(logits, hf_logits(hf_model, prompt), atol=2e-4, rtol=0)
    sequence = prompt + [int(logits[-1].argmax())]
    for _ in range(3):
        last = driver.step({0: sequence[-1:]})[0][-1]
        torch.testing.assert_close(last, hf_logits(hf_model, sequence)[-1], atol=2e-4, rtol=0)
        sequence.append(int(last.argmax()))
