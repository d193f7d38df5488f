import pytest
import torch

from kvtier.models import attention, load_model

from ..tiny_models import ARCHS
from .helpers import make_covering_hf_model


@pytest.fixture(params=["kernel", "torch"])
def attention_path(request, monkeypatch):
    """The attention tests run twice: through the C++ kernels, then through torch alone."""
    if request.param == "torch":
        monkeypatch.setattr(attention, "_cpu_kernel", lambda kv_cache, name: None)
    return request.param


@pytest.fixture(scope="module", params=sorted(ARCHS))
def model_pair(request, tmp_path_factory):
    """(HF fp32 model, our fp32 LoadedModel) for each architecture, loaded from the same dir."""
    directory = tmp_path_factory.mktemp(request.param)
    hf_model = make_covering_hf_model(request.param, directory)
    return hf_model, load_model(str(directory), dtype=torch.float32)
