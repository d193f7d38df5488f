import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from helpers import ARCHS, make_hf_model  # noqa: E402

from kvtier.models import load_model  # noqa: E402


@pytest.fixture(scope="module", params=sorted(ARCHS))
def model_pair(request, tmp_path_factory):
    """(HF fp32 model, our fp32 LoadedModel) for each architecture, loaded from the same dir."""
    directory = tmp_path_factory.mktemp(request.param)
    hf_model = make_hf_model(request.param, directory)
    return hf_model, load_model(str(directory), dtype=torch.float32)
