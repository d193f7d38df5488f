import pytest

from ..tiny_models import make_hf_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """(model directory, HF model) of the tiny random Llama with a byte-level tokenizer and a
    chat template, built once per session."""
    directory = str(tmp_path_factory.mktemp("tiny_llama"))
    return directory, make_hf_model("llama", directory, tokenizer="bytes")
